"""`strop demo` (shortened, both backends) and a real SIGKILL in the middle of `strop sft`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from strop.cli import main
from strop.demo import run_demo
from strop.metrics.sinks import read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SHORT = [
    "ppo.steps=2",
    "ppo.validate_every=2",
    "ppo.validation_size=16",
    "checkpoint.every_steps=2",
]


def _check_demo_outputs(run_dir) -> None:
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "validation/accuracy" in records[0] and "validation/accuracy" in records[-1]
    assert all(0.0 <= r["train/reward"] <= 1.0 for r in records[1:])
    plot = (run_dir / "plot.png").read_bytes()
    assert plot.startswith(PNG_SIGNATURE) and len(plot) > 10_000
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    assert (run_dir / "adapter" / "adapter_config.json").exists()
    assert any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "data" / "train.jsonl").exists()


def test_shortened_demo_writes_metrics_plot_and_adapter(tmp_path):
    run_dir = tmp_path / "demo"
    result = run_demo([f"run_dir={run_dir}", *SHORT])
    assert result.ppo.final_step == 2 and result.backend == "jax"
    _check_demo_outputs(run_dir)
    # Before is the shipped model's greedy accuracy on the first 16 problems; after, the
    # actor's after two iterations: both real fractions of 16.
    assert result.accuracy_before is not None and result.accuracy_after is not None
    assert (16 * result.accuracy_before).is_integer() and 0 < result.accuracy_before < 1
    assert result.plot_path == run_dir / "plot.png"
    assert result.tokens_per_s > 0


def test_shortened_demo_on_the_torch_backend_from_the_cli(tmp_path, capsys):
    run_dir = tmp_path / "demo-torch"
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "backend=torch", f"run_dir={run_dir}", *SHORT])
    assert exit_info.value.code == 0
    _check_demo_outputs(run_dir)
    out = capsys.readouterr().out
    assert "strop demo" in out and "validation accuracy" in out and "torch" in out


def _losses_by_step(run_dir) -> dict[int, float]:
    """Last recorded loss per step (a killed run may have logged a step twice)."""
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def test_sigkill_mid_run_then_resume_gives_the_same_losses(tmp_path, sum_inputs):
    common = ["sft.steps=60", "checkpoint.every_steps=10", "logging.every_steps=1", *sum_inputs]
    sft = [sys.executable, "-m", "strop", "sft", "sft-lora-tiny"]
    straight = subprocess.run([*sft, f"run_dir={tmp_path / 'straight'}", *common], check=False)
    assert straight.returncode == 0

    run_dir = tmp_path / "killed"
    cmd = [*sft, f"run_dir={run_dir}", *common]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "20").exists() and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed_at = max(_losses_by_step(run_dir))
    assert killed_at < 60, "the run finished before the kill; the test proves nothing"

    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from checkpoint step" in done.stderr
    assert _losses_by_step(run_dir) == _losses_by_step(tmp_path / "straight")
    first, last = _losses_by_step(run_dir)[1], _losses_by_step(run_dir)[60]
    assert last < first - 1.0  # and it learned: the sums are easy
