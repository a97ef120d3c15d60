"""`strop demo` (shortened) and a real SIGKILL in the middle of `strop sft`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from strop.demo import run_demo
from strop.metrics.sinks import read_metrics


def test_demo_trains_and_writes_outputs(tmp_path):
    run_dir = tmp_path / "demo"
    result = run_demo([f"run_dir={run_dir}", "sft.steps=30", "sft.eval_every=30"])
    assert result.final_step == 30
    assert result.losses[-1] < result.losses[0] - 1.0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert records[-1]["step"] == 30 and "eval/loss" in records[-1]
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    assert any((run_dir / "tensorboard").iterdir())


def _losses_by_step(run_dir) -> dict[int, float]:
    """Last recorded loss per step (a killed run may have logged a step twice)."""
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def test_sigkill_mid_run_then_resume_gives_the_same_losses(tmp_path):
    common = ["sft.steps=60", "checkpoint.every_steps=10", "logging.every_steps=1"]
    straight = run_demo([f"run_dir={tmp_path / 'straight'}", *common])
    assert straight.final_step == 60

    run_dir = tmp_path / "killed"
    # Share the straight run's inputs so both runs see the same model and data.
    cmd = [
        sys.executable, "-m", "strop", "sft", "sft-lora-tiny", f"run_dir={run_dir}",
        f"model.path={tmp_path / 'straight' / 'inputs' / 'tiny-qwen2'}",
        f"data.train_path={tmp_path / 'straight' / 'inputs' / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'straight' / 'inputs' / 'eval.jsonl'}", *common,
    ]  # fmt: skip
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


def test_demo_runs_on_the_torch_backend(tmp_path):
    run_dir = tmp_path / "demo-torch"
    result = run_demo(["backend=torch", f"run_dir={run_dir}", "sft.steps=30", "sft.eval_every=30"])
    assert result.final_step == 30
    assert result.losses[-1] < result.losses[0] - 1.0
    assert read_metrics(run_dir / "metrics.jsonl")[-1]["step"] == 30
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
