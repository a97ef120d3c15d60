"""The commands' closing tables (:mod:`strop.commands.summaries`) render every row from a result."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from strop.commands import summaries


def rendered(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def run(**fields):
    defaults = dict(run_dir=Path("runs/x"), final_step=3, resumed_from=1, losses=[0.6931, 0.5],
                    export_path=Path("runs/x/adapter"), is_main=True)  # fmt: skip
    return SimpleNamespace(**{**defaults, **fields})


def test_the_training_tables_name_the_run_the_steps_and_the_export():
    text = rendered(summaries.training_summary("strop dpo", run()))
    assert "resumed from step" in text and "0.6931 -> 0.5000" in text and "runs/x/adapter" in text
    history = [{"train/reward": 0.1, "timing/step": 2.0},
               {"train/reward": 0.4, "timing/step": 4.0, "validation/accuracy": 0.5}]  # fmt: skip
    text = rendered(summaries.ppo_summary("strop ppo", run(history=history)))
    assert "0.100 -> 0.400" in text and "50.0%" in text and "3.00 s" in text


def test_the_demo_tables_give_the_accuracy_before_and_after():
    ppo = run(history=[])
    demo = SimpleNamespace(ppo=ppo, backend="jax", accuracy_before=0.523, accuracy_after=0.805,
                           seconds=55.0, tokens_per_s=1234.0, plot_path=Path("runs/x/plot.png"),
                           teacher_accuracy=None, near_teacher=None)  # fmt: skip
    text = rendered(summaries.demo_summary(demo))
    assert "52.3% -> 80.5% (+28.2 points)" in text and "1,234 sampled tok/s" in text
    assert "resumed from iteration" in text and "runs/x/metrics.jsonl" in text
    assert "teacher" not in text
    distilled = SimpleNamespace(
        **{**vars(demo), "teacher_accuracy": 0.867, "near_teacher": (40, 32.4)}
    )
    text = rendered(summaries.demo_summary(distilled))
    assert "86.7% (the same problems)" in text and "at iteration 40 (32 s of iterations)" in text
    dpo = SimpleNamespace(dpo=run(), backend="torch", pairs=281, problems=1024,
                          samples_per_problem=4, pairs_path="runs/x/data/pairs.jsonl",
                          accuracy_before=0.523, accuracy_after=0.699, seconds=33.0,
                          plot_path=None)  # fmt: skip
    text = rendered(summaries.dpo_demo_summary(dpo))
    assert "281 from 1024 problems x 4 samples" in text and "(+17.6 points)" in text
    assert "runs/x/demo.json" in text and "plot" in text
