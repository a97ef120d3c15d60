"""`strop demo distill` against `strop demo` (PPO with a critic) on the same problems.

Both demos start from the shipped tiny-math model (greedy 52.3% on the 256 held-out
problems) with the same LoRA, batch (16 prompts x 4 samples) and sampling; the
distillation's teacher is tiny-math with the shipped PPO-trained adapter (86.7%). Runs the
two demos one after the other on one backend, each in a fresh process and run directory,
and prints each one's accuracy before and after, its iterations and their time, and the
first validated iteration within 3 points of the teacher with the time of the iterations
up to it (``timing/step``: sampling, scoring, the teacher, the updates; validations not
counted)::

    .venv/bin/python benchmarks/distill_vs_ppo.py [--backend torch] [--out runs/distill-vs-ppo]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from strop.assets import teacher_accuracy
from strop.commands.demo import NEAR_TEACHER, first_near
from strop.metrics.sinks import read_metrics

DEMOS = {"ppo (strop demo)": [], "distill (strop demo distill)": ["distill"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="torch", choices=["jax", "torch"])
    parser.add_argument("--out", default="runs/distill-vs-ppo")
    args = parser.parse_args()
    teacher = teacher_accuracy(0)
    assert teacher is not None
    rows = []
    for name, words in DEMOS.items():
        run_dir = Path(args.out) / ("distill" if words else "ppo")
        shutil.rmtree(run_dir, ignore_errors=True)
        command = [sys.executable, "-m", "strop", "demo", *words, f"backend={args.backend}",
                   f"run_dir={run_dir}"]  # fmt: skip
        print(" ".join(command[2:]), flush=True)
        subprocess.run(command, check=True, capture_output=True)
        records = read_metrics(run_dir / "metrics.jsonl")
        accuracy = [r["validation/accuracy"] for r in records if "validation/accuracy" in r]
        seconds = sum(r.get("timing/step", 0.0) for r in records)
        near = first_near(records, teacher - NEAR_TEACHER)
        reached = "not reached" if near is None else f"iteration {near[0]}, {near[1]:.0f} s"
        rows.append((name, f"{accuracy[0]:.1%} -> {accuracy[-1]:.1%}",
                     str(records[-1]["step"]), f"{seconds:.0f} s", reached))  # fmt: skip
    print(f"\nbackend={args.backend}; the teacher: {teacher:.1%}; 'near': within "
          f"{NEAR_TEACHER:.0%} of it\n")  # fmt: skip
    header = ("demo", "greedy accuracy", "iterations", "iteration time", "first near the teacher")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
