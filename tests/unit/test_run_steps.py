"""`strop.run.job.run_steps` when its checkpoint leaves nothing to run: a run past its end is
refused before the restore, and a finished run run again re-exports with its record
files rewritten and every metrics record kept (none is dropped "to be recomputed")."""

from __future__ import annotations

from pathlib import Path

import pytest

from strop.backends import get_backend
from strop.config import load_config
from strop.errors import ConfigError
from strop.run.job import Job, run_steps
from strop.run.kinds import run_kind
from strop.run.preflight import RunFacts
from strop.run.progress import RunProgress

METRICS = b'{"step": 3, "train/loss": 1.0}\n{"step": 4, "train/loss": 2.0}\n'


class FinishedModel:
    """A model whose newest checkpoint is ``latest``; it records what it was asked."""

    is_main = True

    def __init__(self, latest: int):
        self.latest, self.calls = latest, []

    def latest_checkpoint(self) -> int:
        return self.latest

    def restore_checkpoint(self, step: int) -> dict:
        self.calls.append(f"restore {step}")
        return {"step": step}

    def export_adapter(self, out: Path, overwrite: bool) -> Path:
        self.calls.append("export")
        return out


class NoSteps:
    always_written = ()

    def __init__(self, model):
        self.model = model

    def restore_counters(self, saved):
        pass

    def step(self, step: int):
        raise AssertionError(f"step {step} ran")


def run(tmp_path, latest: int, total: int):
    config = load_config("tiny", [f"run_dir={tmp_path}", f"sft.steps={total}", "backend=torch"])
    (tmp_path / "metrics.jsonl").write_bytes(METRICS)
    model = FinishedModel(latest)
    job = Job(
        RunFacts(run_kind("sft"), get_backend("torch")),
        RunProgress("sft", total, {}, enabled=False),
    )
    return model, run_steps(config, NoSteps(model), job, total=total, stop_after=None)


def test_a_checkpoint_past_the_end_is_refused_before_the_restore(tmp_path):
    with pytest.raises(ConfigError, match=r"already holds checkpoint step 4, past sft\.steps=3"):
        run(tmp_path, latest=4, total=3)
    assert (tmp_path / "metrics.jsonl").read_bytes() == METRICS
    assert not (tmp_path / "config.yaml").exists()


def test_a_finished_run_run_again_keeps_every_metrics_record(tmp_path):
    model, finished = run(tmp_path, latest=3, total=3)
    assert model.calls == ["restore 3", "export"] and finished.records == []
    assert (tmp_path / "metrics.jsonl").read_bytes() == METRICS  # step 4 was not dropped
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "versions.json").is_file()
