"""A full disk is one line: every file strop writes (metrics, samples, TensorBoard, W&B's
run directory, exports, plots, eval results, the run record) fails with one
:class:`~strop.errors.WriteError` naming what it was writing, where, and the free space
there; and the first error of a run wins (a later writer failing on the same disk while
the run stops does not bury it).

The disk is real: a small tmpfs filled up (ENOSPC from the OS), skipped where mounting
is not permitted (tests/mounts.py)."""

from __future__ import annotations

import numpy as np
import pytest

from strop.errors import CheckpointError, WriteError
from strop.metrics.sinks import MetricsWriter
from tests.mounts import tmpfs

NO_SPACE = "No space left on device"


def fill(directory) -> None:
    """Write zeros into ``directory`` until its filesystem is full."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    with open(directory / "filler-tail", "wb", buffering=0) as f:  # the last partial page
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass


@pytest.fixture
def disk(tmp_path):
    """A 128 KiB tmpfs, to be filled by the test."""
    with tmpfs(tmp_path / "disk", "128k") as mounted:
        yield mounted


def refusal(what: str, path) -> str:
    return rf"^writing {what} to {path} failed: .*{NO_SPACE}.*\(\d+ KiB free there\)"


def test_metrics_and_samples_fail_in_one_line_naming_the_file(disk):
    with MetricsWriter(disk / "run", tensorboard=False) as writer:
        writer.write(1, {"train/loss": 1.0})
        fill(disk)
        with pytest.raises(WriteError, match=refusal("samples", disk / "run" / "samples.jsonl")):
            writer.write_samples(2, [{"prompt": "p" * 5000, "response": "r"}])
        with pytest.raises(WriteError, match=refusal("metrics", disk / "run" / "metrics.jsonl")):
            writer.write(2, {"train/loss": 0.5, "note": "x" * 9000})


def test_tensorboard_fails_at_the_write_not_in_a_thread_or_at_close(tmp_path):
    """Before: tensorboardX wrote from a thread of its own and failed at the final flush,
    an OSError traceback after the run's work (or, mid-run, a thread's traceback)."""
    board = tmp_path / "run" / "tensorboard"
    with tmpfs(board, "16k"), MetricsWriter(tmp_path / "run", tensorboard=True) as writer:
        fill(board)
        with pytest.raises(WriteError, match=refusal("TensorBoard logs", board)):
            for step in range(1, 200):  # until its own page is full: a few steps
                writer.write(step, {f"train/metric_{i}": float(i) for i in range(20)})


def test_the_first_error_wins_over_a_writer_failing_as_the_run_stops(disk):
    """The issue's run: a checkpoint save fills the disk and fails in one line, then the
    TensorBoard flush at close failed on the same disk and buried it (exit 1)."""
    with (
        pytest.raises(CheckpointError, match="saving checkpoint step 2"),
        MetricsWriter(disk / "run", tensorboard=True) as writer,
    ):
        for step in range(1, 40):
            writer.write(step, {f"train/metric_{i}": float(i) for i in range(20)})
        fill(disk)
        raise CheckpointError("saving checkpoint step 2 to ... failed")


def test_exports_fail_in_one_line(disk):
    """Before: `strop export --merged` on a full disk ended in a SafetensorError traceback."""
    from strop.io.hf import write_checkpoint
    from strop.io.peft import save_adapter

    fill(disk)
    tensors = [("model.embed_tokens.weight", np.zeros((64, 512), np.float32))]
    with pytest.raises(WriteError, match=refusal("the model", disk / "merged")):
        write_checkpoint(disk / "merged", {"model_type": "qwen2"}, tensors, dtype_name="float32")
    weights = {"model.layers.0.self_attn.q_proj": (np.zeros((8, 64)), np.zeros((64, 8)))}
    with pytest.raises(WriteError, match=refusal("the adapter", disk / "adapter")):
        save_adapter(
            disk / "adapter", weights, rank=8, alpha=16, dropout=0.0,
            target_modules=["q_proj"], base_model=None,
        )  # fmt: skip
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "filler-tail"]  # no staging


def test_a_plot_and_the_run_record_fail_in_one_line(disk):
    from strop.commands.plot import plot_run
    from strop.config import load_config
    from strop.io.run_record import record_run

    run = disk / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(f'{{"step": {s}, "train/reward": {s / 10}}}\n' for s in range(30))
    )
    fill(disk)
    with pytest.raises(WriteError, match=refusal("the plot", run / "plot.png")):
        plot_run(run)
    with pytest.raises(WriteError, match=refusal("config.yaml", run / "config.yaml")):
        record_run(load_config("tiny", [f"run_dir={run}"]), "sft")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # no staging left


def test_wandb_fails_in_one_line_and_the_first_error_still_wins(disk, monkeypatch, capfd):
    """Before: W&B's own debug log printed a "--- Logging error ---" traceback for each
    record on a full disk (5,081 lines for 20 steps) and `finish` raised an OSError."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = disk / "run"
    run.mkdir()
    (run / "wandb-run-id").write_text("strop0full0disk\n")  # a resumed run has one
    fill(disk)
    wandb = ("strop", {"optim": {"lr": 1e-4}})
    with (
        pytest.raises(WriteError, match=refusal("metrics", run / "metrics.jsonl")),
        MetricsWriter(run, tensorboard=False, wandb=wandb) as writer,
    ):
        writer.write(1, {"train/loss": 1.0, "note": "x" * 9000})  # then W&B's finish fails
    with (
        pytest.raises(WriteError, match=refusal("W&B's run files", run / "wandb")),
        MetricsWriter(run, tensorboard=False, wandb=wandb),
    ):
        pass  # nothing logged: W&B's own files fail (its init, once a run failed here)
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr and "Logging error" not in stderr, stderr[-3000:]
