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
