"""What both peer scripts share: the job's data, prompt, reward and result line.

Standard library only: this file is imported inside the peers' own virtualenvs, which do
not have strop. The reward is a small copy of strop's ``gsm8k`` reward's fast path: the
answer is the rest of the line after the last ``####`` (else the last number in the
text), and it scores 1.0 when it is the same number as the gold answer, else 0.0.
(strop also reads ``\\boxed{}``, units and, for math it cannot parse, asks math-verify;
none of that changes the time of an iteration on these problems.)
"""

from __future__ import annotations

import json
import re
import statistics
from decimal import Decimal, InvalidOperation
from fractions import Fraction

PROMPT_TEMPLATE = "Question: {question}\nAnswer:"  # strop's data.prompt_template default
# strop's demo recipe as the peers take it; benchmarks/peers.py passes the resolved one
# (``--job JSON``, from strop's config), so these only serve a peer script run by hand.
DEFAULT_JOB = {
    "rollouts": 64,
    "mini_batch": 32,
    "epochs": 1,
    "samples": 4,
    "max_new_tokens": 48,
    "temperature": 1.0,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "lr": 1e-3,
    "critic_lr": 3e-3,
    "weight_decay": 0.01,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "max_grad_norm": 1.0,
    "gamma": 1.0,
    "lam": 1.0,
    "clip_low": 0.2,
    "clip_high": 0.2,
    "dual_clip": 3.0,
    "value_clip": 0.5,
    "value_loss_coef": 0.5,
    "kl_coef": 0.0,
}
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def job(text: str | None) -> dict:
    """The job's settings: ``DEFAULT_JOB`` updated with the JSON ``text``."""
    return {**DEFAULT_JOB, **(json.loads(text) if text else {})}


def read_problems(path: str) -> list[dict[str, str]]:
    """The GSM8K-style records of ``path`` as ``{"prompt", "gold"}``."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                gold = record["answer"].rsplit("####", 1)[1].strip()
                out.append({"prompt": PROMPT_TEMPLATE.format(**record), "gold": gold})
    return out


def _answer(text: str) -> str | None:
    at = text.rfind("####")
    if at >= 0:
        rest = text[at + 4 :].split("\n", 1)[0].strip()
        if rest:
            return rest
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _number(text: str) -> Fraction | None:
    try:
        return Fraction(Decimal(text.replace(",", "").strip().rstrip(".")))
    except (InvalidOperation, ValueError):
        return None


def reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer is the gold number, else 0.0."""
    answer = _answer(completion)
    value = None if answer is None else _number(answer)
    return float(value is not None and value == _number(gold))


def print_result(seconds: list[float], **extra) -> None:
    """The one line the driver reads: per-iteration seconds and anything else."""
    later = seconds[1:] or seconds
    print(
        "RESULT "
        + json.dumps({"seconds": seconds, "median_after_first": statistics.median(later), **extra}),
        flush=True,
    )
