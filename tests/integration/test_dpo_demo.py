"""`strop demo dpo`, shortened, on the torch backend from the CLI: the problems, the pairs
from the shipped model's own samples, the DPO run's metrics and adapter, the greedy
evaluations before and after, the summary and the table; a rerun reuses the pairs.

The full-length demo's gain (+10 points or more on both backends) is checked in
``tests/acceptance/test_demo.py``.
"""

from __future__ import annotations

import json

import pytest

from strop.cli import main
from strop.commands import demo_dpo as demo
from strop.metrics.sinks import read_metrics

SHORT = ["backend=torch", "eval.max_examples=8", "dpo.steps=1", "dpo.batch_size=2",
         "dpo.micro_batch_size=2", "checkpoint.every_steps=1"]  # fmt: skip


def test_shortened_dpo_demo_from_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "N_TRAIN", 16)
    monkeypatch.setattr(demo, "N_VALIDATION", 8)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "dpo", *SHORT])
    assert exit_info.value.code == 0
    run_dir = tmp_path / "runs" / "demo-dpo-torch"  # the backend's own run directory

    pairs_path = run_dir / "data" / "pairs.jsonl"
    pairs = [json.loads(line) for line in pairs_path.read_text().splitlines()]
    assert pairs and all(p["prompt"].startswith("Question: ") for p in pairs)
    assert all(p["chosen"] != p["rejected"] and "####" in p["chosen"] for p in pairs)
    sampled = [json.loads(line) for line in
               (run_dir / "sampled" / "eval" / "results.jsonl").read_text().splitlines()]  # fmt: skip
    assert len(sampled) == 8 and all(len(r["responses"]) == 4 for r in sampled)

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1] and "dpo/loss" in records[0]
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    assert (run_dir / "plot.png").exists()
    summary = json.loads((run_dir / "demo.json").read_text())
    assert summary["pairs"] == len(pairs) and summary["backend"] == "torch"
    for stage in ("before", "after"):
        evaluated = json.loads((run_dir / stage / "eval" / "summary.json").read_text())
        assert evaluated["examples"] == 8 and evaluated["samples_per_example"] == 1
        assert summary[f"accuracy_{stage}"] == evaluated["accuracy"]
    out = capsys.readouterr().out
    assert "strop demo dpo" in out and "validation accuracy (greedy)" in out
    assert f"{len(pairs)} from 8 problems x 4 samples" in out

    written = pairs_path.stat().st_mtime_ns  # a rerun samples nothing: the pairs are kept
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "dpo", *SHORT])
    assert exit_info.value.code == 0
    assert pairs_path.stat().st_mtime_ns == written
    assert "validation accuracy (greedy)" in capsys.readouterr().out
