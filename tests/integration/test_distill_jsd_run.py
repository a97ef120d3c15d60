"""``strop distill ... distill.loss=jsd`` end to end on torch: two iterations of a tiny
random student distilled from another tiny random model with the same tokenizer (the
inputs of ``test_distill_run.py``), each iteration's ``distill/jsd`` in the metrics."""

from __future__ import annotations

import math

import pytest

from strop.cli import main
from strop.metrics.sinks import read_metrics
from tests.integration.test_distill_run import COMMON, distill_inputs  # noqa: F401 (a fixture)


def test_the_cli_distills_with_the_jsd(distill_inputs, tmp_path):  # noqa: F811
    """The student's update is the JSD's (PPO's clipped loss never runs); the teacher has
    other weights, so the divergence is > 0 at every iteration. With ``distill.lmbda=0.5``
    the seeded draw gives iteration 1 to the records' completions (GKD) and iteration 2 to
    the student's samples."""
    root, inputs = distill_inputs
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["distill", "ppo-lora-tiny", *inputs, *COMMON, f"distill.teacher={root / 'teacher'}",
              "backend=torch", f"run_dir={run_dir}", "distill.loss=jsd", "distill.beta=0.3",
              "distill.chunk_tokens=16", "distill.lmbda=0.5"])  # fmt: skip
    assert done.value.code in (0, None)
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["distill/on_policy"] for r in records] == [0.0, 1.0]  # use_records(0, step, 0.5)
    for record in records:
        assert math.isfinite(record["distill/jsd"]) and record["distill/jsd"] > 1e-3, record
        assert record["policy/loss"] == pytest.approx(record["distill/jsd"])
        assert record["policy/grad_norm"] > 0 and record["policy/nonfinite_skipped"] == 0
        assert "policy/clipfrac" not in record and "distill/reverse_kl" not in record
