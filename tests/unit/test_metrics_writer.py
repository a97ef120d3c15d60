"""metrics.jsonl across a kill and a resume: each step once, in order, nothing torn."""

from __future__ import annotations

import json

from strop.metrics import MetricsWriter
from strop.metrics.sinks import read_metrics


def write_steps(run_dir, steps, **kwargs):
    with MetricsWriter(run_dir, tensorboard=False, **kwargs) as writer:
        for step in steps:
            writer.write(step, {"train/loss": float(step)})


def test_resume_drops_the_killed_attempts_records_and_a_torn_line(tmp_path, caplog):
    write_steps(tmp_path, range(1, 8))  # the killed attempt got to step 7 ...
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 8, "train/lo')  # ... and was killed writing step 8
    caplog.set_level("INFO")
    write_steps(tmp_path, range(5, 9), keep_through=4)  # resumed from checkpoint 4
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["train/loss"] == r["step"] for r in records)
    assert "dropped 3 record(s) after step 4 and a torn last line" in caplog.text


def test_fresh_start_clears_records_of_a_run_that_never_checkpointed(tmp_path):
    write_steps(tmp_path, [0, 1, 2])
    write_steps(tmp_path, [0, 1], keep_through=-1)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_without_keep_through_records_are_appended_and_unknown_lines_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("not json\n" + json.dumps({"step": 9, "x": 1}) + "\n")
    write_steps(tmp_path, [1])
    assert path.read_text().splitlines()[:2] == ["not json", '{"step": 9, "x": 1}']
    write_steps(tmp_path, [2], keep_through=1)  # drops step 9, keeps what it cannot read
    assert path.read_text().splitlines() == [
        "not json", '{"step": 1, "train/loss": 1.0}', '{"step": 2, "train/loss": 2.0}'
    ]  # fmt: skip
