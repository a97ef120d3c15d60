"""Synthetic GSM8K-style word problems: one to three arithmetic steps on small numbers.

Each record has the GSM8K JSONL layout that :mod:`strop.data.sources` reads::

    {"question": "Mia has 7 pens. She buys 5 more. How many pens does Mia have now?",
     "answer": "7 + 5 = 12\\n#### 12"}

The answer is a short worked solution, one ``a op b = c`` line per step (``op`` is ``+``,
``-`` or ``*``; each line starts from the previous result), then ``#### N``. Every
intermediate and final value is a non-negative integer below :data:`MAX_VALUE`.

A problem follows one person and one kind of item. Its first step is either a quantity
the person has (no arithmetic) or a product ("buys 4 boxes with 6 pens in each"); the
other steps buy, find or receive more (``+``), give away, sell or lose some (``-``), or
multiply what the person has ("ends up with 3 times as many"). Sentences come from a few
templates per operation, so the wording varies.

Everything is a pure function of the seed: the same ``(n, seed, max_steps)`` gives the same
records, in the same order, on every machine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strop.errors import ConfigError
from strop.io.atomic import atomic_directory

MAX_VALUE = 200  # every value in a problem is in [0, MAX_VALUE)
OPS = ("+", "-", "*")

# (name, subject pronoun, object pronoun)
PEOPLE = (
    ("Mia", "she", "her"),
    ("Tom", "he", "him"),
    ("Ava", "she", "her"),
    ("Leo", "he", "him"),
    ("Zoe", "she", "her"),
    ("Sam", "he", "him"),
    ("Ivy", "she", "her"),
    ("Max", "he", "him"),
    ("Nora", "she", "her"),
    ("Ben", "he", "him"),
)
FRIENDS = ("Ana", "Raj", "Kim", "Eli", "Lucy", "Omar")
# (plural item, container for products)
ITEMS = (
    ("apples", "bags"),
    ("pens", "boxes"),
    ("stickers", "packs"),
    ("marbles", "jars"),
    ("cookies", "trays"),
    ("cards", "packs"),
    ("shells", "buckets"),
    ("books", "shelves"),
)

# Templates; fields: {name} {he} {him} {item} {box} {friend} {a} {b}.
START = (
    "{name} has {a} {item}.",
    "{name} collects {a} {item}.",
    "There are {a} {item} in {name}'s room.",
)
START_PRODUCT = (
    "{name} buys {a} {box} of {item} with {b} {item} in each.",
    "{name} has {a} {box}, and each holds {b} {item}.",
)
STEP = {
    "+": (
        "{he} buys {b} more {item}.",
        "{he} finds {b} more.",
        "{friend} gives {him} {b} {item}.",
    ),
    "-": (
        "{he} gives {b} {item} to {friend}.",
        "{he} sells {b} of them.",
        "{he} loses {b} {item}.",
    ),
    "*": (
        "Then {he} ends up with {b} times as many {item}.",
        "{he} buys more until {he} has {b} times as many.",
    ),
}
ASK = (
    "How many {item} does {name} have now?",
    "How many {item} does {name} have in the end?",
)


@dataclass(frozen=True)
class Step:
    """One line of a solution: ``left op right = result`` (all ints in ``[0, MAX_VALUE)``)."""

    left: int
    op: str
    right: int
    result: int

    def line(self) -> str:
        return f"{self.left} {self.op} {self.right} = {self.result}"


@dataclass(frozen=True)
class Problem:
    """A word problem, its solution steps (1 to 3) and its final answer."""

    question: str
    steps: tuple[Step, ...]

    @property
    def result(self) -> int:
        return self.steps[-1].result

    def to_record(self, early_answer: bool = False) -> dict[str, str]:
        """The GSM8K record: ``{"question": ..., "answer": "<steps>\\n#### N"}``.

        ``early_answer`` writes a flawed demonstration: every step is worked out correctly,
        but ``#### N`` gives the *first* step's result (wrong when there are several steps).
        """
        lines = [step.line() for step in self.steps]
        final = self.steps[0].result if early_answer else self.result
        return {"question": self.question, "answer": "\n".join([*lines, f"#### {final}"])}


def apply_op(left: int, op: str, right: int) -> int:
    """``left op right`` for ``op`` in :data:`OPS`."""
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    raise ValueError(f"unknown operation {op!r}; expected one of {OPS}")


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """A uniform integer in ``[low, high]`` (both included)."""
    return int(rng.integers(low, high + 1))


def _pick(rng: np.random.Generator, options: tuple):
    return options[int(rng.integers(len(options)))]


def make_problem(rng: np.random.Generator, num_steps: int) -> Problem:
    """One problem with ``num_steps`` arithmetic steps (1 to 3), drawn from ``rng``."""
    if not 1 <= num_steps <= 3:
        raise ConfigError(f"a synthetic problem has 1 to 3 steps, got {num_steps}")
    name, he, him = _pick(rng, PEOPLE)
    item, box = _pick(rng, ITEMS)
    fields = {"name": name, "he": he, "him": him, "item": item, "box": box}

    def say(template: str, **numbers: int) -> str:
        text = template.format(**fields, friend=_pick(rng, FRIENDS), **numbers)
        return text[0].upper() + text[1:]

    sentences, steps = [], []
    # A product start is one of the steps; a plain start is none.
    if rng.random() < 0.3:
        a, b = _int(rng, 2, 6), _int(rng, 2, 10)
        sentences.append(say(_pick(rng, START_PRODUCT), a=a, b=b))
        steps.append(Step(a, "*", b, a * b))
        value = a * b
    else:
        value = _int(rng, 2, 30)
        sentences.append(say(_pick(rng, START), a=value))
    while len(steps) < num_steps:
        op = _pick(rng, OPS)
        if op == "*" and value > 25:
            op = "+"
        if op == "-" and value < 2:
            op = "+"
        if op == "+":
            right = _int(rng, 1, min(20, MAX_VALUE - 1 - value))
        elif op == "-":
            right = _int(rng, 1, value - 1)
        else:
            right = _int(rng, 2, min(4, (MAX_VALUE - 1) // value))
        result = apply_op(value, op, right)
        sentences.append(say(_pick(rng, STEP[op]), b=right))
        steps.append(Step(value, op, right, result))
        value = result
    sentences.append(say(_pick(rng, ASK)))
    return Problem(" ".join(sentences), tuple(steps))


def make_problems(n: int, seed: int, max_steps: int = 3) -> list[dict[str, str]]:
    """``n`` GSM8K records (distinct questions), steps uniform in ``1..max_steps``."""
    return [p.to_record() for p in _problems(n, seed, max_steps)]


def _problems(
    n: int, seed: int | list[int], max_steps: int, exclude: frozenset[str] = frozenset()
) -> list[Problem]:
    if n < 0:
        raise ConfigError(f"the number of problems must be >= 0, got {n}")
    if not 1 <= max_steps <= 3:
        raise ConfigError(f"max_steps must be 1, 2 or 3, got {max_steps}")
    rng = np.random.default_rng(seed)
    seen = set(exclude)
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 20 * n + 1000:
            raise ConfigError(
                f"cannot make {n} distinct problems with max_steps={max_steps}; ask for fewer"
            )
        problem = make_problem(rng, _int(rng, 1, max_steps))
        if problem.question in seen:
            continue
        seen.add(problem.question)
        out.append(problem)
    return out


def write_splits(
    out_dir: str | os.PathLike,
    seed: int,
    n_train: int,
    n_validation: int,
    *,
    max_steps: int = 3,
    early_answer_fraction: float = 0.0,
    overwrite: bool = True,
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``validation.jsonl`` into ``out_dir``; return their paths.

    Each split has its own random stream derived from ``seed``; train problems skip every
    validation question, so the splits are disjoint and the validation split does not
    change with ``n_train``. ``out_dir`` appears only when both files are complete.

    ``early_answer_fraction`` makes the *train* split flawed demonstrations for SFT: that
    fraction of its records (a seeded choice) give the first step's result as the final
    answer (:meth:`Problem.to_record`). The questions stay the same and the validation
    split stays correct. Never train PPO on such a split: its golds would be wrong.
    """
    if not 0.0 <= early_answer_fraction <= 1.0:
        raise ConfigError(f"early_answer_fraction must be in [0, 1], got {early_answer_fraction}")
    validation = _problems(n_validation, [seed, 1], max_steps)
    train = _problems(
        n_train, [seed, 2], max_steps, exclude=frozenset(p.question for p in validation)
    )
    flawed = np.random.default_rng([seed, 3]).random(len(train)) < early_answer_fraction
    out = Path(out_dir)
    with atomic_directory(out, overwrite=overwrite) as staging:
        for name, records in (
            ("train", [p.to_record(bool(f)) for p, f in zip(train, flawed, strict=True)]),
            ("validation", [p.to_record() for p in validation]),
        ):
            lines = "".join(json.dumps(record) + "\n" for record in records)
            (staging / f"{name}.jsonl").write_text(lines, encoding="utf-8")
    return split_paths(out)


def split_paths(out_dir: str | os.PathLike) -> dict[str, Path]:
    """The files :func:`write_splits` writes into ``out_dir``, by split name."""
    out = Path(out_dir)
    return {"train": out / "train.jsonl", "validation": out / "validation.jsonl"}


def write_sum_problems(path: str | os.PathLike, count: int, seed: int) -> list[str]:
    """``count`` prompt/completion lines ``What is a + b?`` -> `` a+b`` (``a, b < 50``) into
    ``path``, a quick SFT task for tiny random models; returns the full texts."""
    rng = np.random.default_rng(seed)
    texts, lines = [], []
    for _ in range(count):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        record = {"prompt": f"What is {a} + {b}?", "completion": f" {a + b}"}
        lines.append(json.dumps(record) + "\n")
        texts.append(record["prompt"] + record["completion"])
    Path(path).write_text("".join(lines), encoding="utf-8")
    return texts
