"""`strop demo`: LoRA SFT end to end on a laptop CPU, with nothing but strop installed.

Makes synthetic "What is a + b?" data and a tiny random Qwen2 (with a tokenizer trained on
that data), then runs the ``sft-lora-tiny`` recipe and reports the loss before and after.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from strop.config import load_config
from strop.io.tiny import make_tiny_checkpoint
from strop.sft.loop import SftResult, run_sft


def write_sum_problems(path: Path, count: int, seed: int) -> list[str]:
    """``count`` prompt/completion lines ``What is a + b?`` -> `` a+b``; returns the texts."""
    rng = np.random.default_rng(seed)
    texts = []
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            a, b = (int(x) for x in rng.integers(0, 50, 2))
            record = {"prompt": f"What is {a} + {b}?", "completion": f" {a + b}"}
            f.write(json.dumps(record) + "\n")
            texts.append(record["prompt"] + record["completion"])
    return texts


def run_demo(overrides: Sequence[str] = ()) -> SftResult:
    """Prepare data and model under the run directory and train; returns the SFT result."""
    config = load_config("sft-lora-tiny", overrides)
    work = Path(config.run_dir) / "inputs"
    work.mkdir(parents=True, exist_ok=True)
    texts = write_sum_problems(work / "train.jsonl", 1024, seed=config.seed)
    write_sum_problems(work / "eval.jsonl", 64, seed=config.seed + 1)
    model_dir = work / "tiny-qwen2"
    if not (model_dir / "config.json").exists():
        make_tiny_checkpoint(model_dir, texts, seed=config.seed)
    config = load_config(
        "sft-lora-tiny",
        [
            f"model.path={model_dir}",
            f"data.train_path={work / 'train.jsonl'}",
            f"data.eval_path={work / 'eval.jsonl'}",
            *overrides,
        ],
    )
    return run_sft(config)
