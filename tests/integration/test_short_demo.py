"""`strop demo`, shortened, on the torch backend from the CLI: metrics, plot, adapter,
TensorBoard, data.

The default (JAX) demo's outputs are checked on its full run (``tests/acceptance``), which
the suite runs anyway; SIGKILL and resume: ``test_kill_resume.py``.
"""

from __future__ import annotations

import pytest

from strop.cli import main
from strop.metrics.sinks import read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SHORT = [
    "ppo.steps=2",
    "ppo.validate_every=10",  # validation at 0 and at the last iteration all the same
    "ppo.validation_size=16",
    "checkpoint.every_steps=2",
]


def check_demo_outputs(run_dir, steps: int = 2) -> None:
    """What a demo run of ``steps`` iterations leaves in ``run_dir`` for its user."""
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps + 1))
    assert "validation/accuracy" in records[0] and "validation/accuracy" in records[-1]
    assert all(0.0 <= r["train/reward"] <= 1.0 for r in records[1:])
    plot = (run_dir / "plot.png").read_bytes()
    assert plot.startswith(PNG_SIGNATURE) and len(plot) > 10_000
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    assert (run_dir / "adapter" / "adapter_config.json").exists()
    assert any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "data" / "train.jsonl").exists()


def test_shortened_demo_on_the_torch_backend_from_the_cli(tmp_path, capsys, monkeypatch):
    """Without run_dir, each backend has its own default (a torch demo does not try to
    resume a JAX one's checkpoints)."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "demo-torch"
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "backend=torch", *SHORT])
    assert exit_info.value.code == 0
    check_demo_outputs(run_dir)
    out = capsys.readouterr().out
    assert "strop demo" in out and "validation accuracy" in out and "torch" in out


def test_the_agent_demo_from_the_cli_runs_the_calculator_recipe(tmp_path, capsys, monkeypatch):
    """`strop demo env.name=calculator`, one tiny iteration on torch: the shipped tiny-calc
    model plays episodes in the calculator environment on the arithmetic problems the demo
    writes, in its own run directory, and reports before/after accuracy."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "env.name=calculator", "backend=torch", "ppo.steps=1",
              "ppo.prompts_per_step=2", "ppo.num_generations_per_prompt=2",
              "ppo.mini_batch_size=4", "ppo.validation_size=4", "ppo.validate_every=1"])  # fmt: skip
    assert exit_info.value.code == 0
    run_dir = tmp_path / "runs" / "demo-calc-torch"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert "validation/accuracy" in records[0] and "env/tool_calls" in records[1]
    assert "####" in (run_dir / "data" / "validation.jsonl").read_text()
    assert (run_dir / "plot.png").read_bytes().startswith(PNG_SIGNATURE)
    out = capsys.readouterr().out
    assert "strop demo" in out and "validation accuracy" in out and "torch" in out


def test_the_distill_demo_from_the_cli_distills_the_shipped_teacher(tmp_path, capsys, monkeypatch):
    """`strop demo distill`, one iteration on torch: the shipped tiny-math student, the
    teacher with the shipped adapter, the demo's problems; the summary says the teacher's
    accuracy and how near the student came."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "distill", "backend=torch", "ppo.steps=1", "ppo.validation_size=16",
              "ppo.validate_every=1"])  # fmt: skip
    assert exit_info.value.code == 0
    records = read_metrics(tmp_path / "runs" / "demo-distill-torch" / "metrics.jsonl")
    assert records[-1]["distill/reverse_kl"] > 0  # the teacher's adapter: another policy
    out = capsys.readouterr().out
    assert "teacher's accuracy" in out and "within 3 points of it" in out
