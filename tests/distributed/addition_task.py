"""The tiny PPO task the multi-process tests share: addition questions and a model that
has seen their answers (so rewards are not all zero)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_addition_task(root: Path, questions: int = 32) -> None:
    """``root/train.jsonl`` (GSM8K-style ``question``/``answer``) and ``root/model``."""
    from strop.io.tiny import make_tiny_checkpoint

    rng = np.random.default_rng(0)
    with (root / "train.jsonl").open("w") as f:
        for _ in range(questions):
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"}))
            f.write("\n")
    texts = [f"Question: What is {a} + {b}?\nAnswer: {a + b}" for a in range(10) for b in range(10)]
    # one layer: these tests check what several processes compute against one, and a layer
    # fewer is a third less to compile in every process
    make_tiny_checkpoint(root / "model", texts, seed=0, layers=1)
