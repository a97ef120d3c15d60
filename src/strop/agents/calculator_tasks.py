"""Arithmetic a tiny model cannot do in its head, for the ``calculator`` environment, and
tool-use demonstrations of it with a flaw put in on purpose.

A problem is a product of a 2-3 digit and a 2 digit number, alone or with one more step
(``a * b``, ``a * b + c``, ``a * b - c``, ``(a + b) * c``), asked in one of a few
phrasings, or a one-line word problem whose answer is ``a * b``. Records have the GSM8K
layout (:mod:`strop.data.sources` reads them; the calculator's ``correct`` score reads the
gold after ``####``)::

    {"question": "What is 347 * 86 + 15?", "answer": "347 * 86 + 15 = 29857\\n#### 29857"}

A demonstration is a chat in the OpenAI / Hugging Face format (``messages`` and ``tools``,
what ``strop sft`` trains on) as the calculator environment opens it (its system prompt,
the question, its ``calculate`` tool), then either the tool path -- an assistant turn that
calls ``calculate`` with the problem's expression, the tool's result, and ``#### N`` -- or
a guess: ``#### G`` with no call, ``G`` the answer with its last two digits made up (never
right). How often a demonstration takes the tool path depends on the phrasing: the
*careful* phrasings call the tool :data:`TOOL_RATES` ``["careful"]`` of the time, the
*casual* ones only ``["casual"]`` of the time. A model trained on them calls the tool
where the annotator did and guesses elsewhere; a reward for the right answer is what can
teach it to call the tool everywhere.

Everything is a pure function of the seed, the same on every machine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from strop.errors import ConfigError
from strop.io.atomic import atomic_directory

# (phrasing, careful): {e} is the expression; word problems use {a}, {b}, {name}, {item}.
PHRASINGS = (
    ("What is {e}?", True),
    ("Calculate {e}.", True),
    ("{name} packs {a} boxes with {b} {item} in each. How many {item} is that?", True),
    ("Work out {e}.", False),
    ("How much is {e}?", False),
    ("Find {e}.", False),
    ("{name} buys {a} bags of {b} {item}. How many {item} does {name} get?", False),
)
# How often a demonstration calls the tool, by the phrasing's kind.
TOOL_RATES = {"careful": 0.9, "casual": 0.2}
NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Nora", "Ben")
ITEMS = ("apples", "pens", "stickers", "marbles", "cookies", "cards", "shells", "beads")
SHAPES = ("a * b", "a * b + c", "a * b - c", "(a + b) * c")


@dataclass(frozen=True)
class CalcProblem:
    """A question, the expression that answers it, its value and whether its phrasing is
    a careful one (see the module docstring)."""

    question: str
    expression: str
    value: int
    careful: bool

    def to_record(self) -> dict[str, str]:
        """The GSM8K record: ``{"question": ..., "answer": "<expression> = N\\n#### N"}``."""
        answer = f"{self.expression} = {self.value}\n#### {self.value}"
        return {"question": self.question, "answer": answer}


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    return int(rng.integers(low, high + 1))


def make_calc_problem(rng: np.random.Generator) -> CalcProblem:
    """One problem drawn from ``rng``."""
    template, careful = PHRASINGS[int(rng.integers(len(PHRASINGS)))]
    if "{e}" not in template:
        a, b = _int(rng, 12, 99), _int(rng, 12, 99)
        name, item = NAMES[int(rng.integers(len(NAMES)))], ITEMS[int(rng.integers(len(ITEMS)))]
        question = template.format(name=name, item=item, a=a, b=b)
        return CalcProblem(question, f"{a} * {b}", a * b, careful)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    a, b = _int(rng, 12, 999), _int(rng, 12, 99)
    if shape == "a * b":
        expression, value = f"{a} * {b}", a * b
    elif shape == "a * b + c":
        c = _int(rng, 2, 999)
        expression, value = f"{a} * {b} + {c}", a * b + c
    elif shape == "a * b - c":
        c = _int(rng, 2, min(999, a * b - 1))
        expression, value = f"{a} * {b} - {c}", a * b - c
    else:
        c = _int(rng, 12, 999)
        expression, value = f"({a} + {c}) * {b}", (a + c) * b
    return CalcProblem(template.format(e=expression), expression, value, careful)


def make_calc_problems(
    n: int, seed: int | list[int], exclude: frozenset[str] = frozenset()
) -> list[CalcProblem]:
    """``n`` problems with distinct questions (none in ``exclude``)."""
    if n < 0:
        raise ConfigError(f"the number of problems must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    seen, out = set(exclude), []
    while len(out) < n:
        problem = make_calc_problem(rng)
        if problem.question not in seen:
            seen.add(problem.question)
            out.append(problem)
    return out


def calc_splits(
    seed: int, n_train: int, n_validation: int
) -> tuple[list[CalcProblem], list[CalcProblem]]:
    """The train and validation problems: each split has its own random stream derived
    from ``seed``, the train split skips every validation question, and the validation
    split does not change with ``n_train``."""
    validation = make_calc_problems(n_validation, [seed, 11])
    train = make_calc_problems(n_train, [seed, 12], frozenset(p.question for p in validation))
    return train, validation


def guess(value: int, rng: np.random.Generator) -> int:
    """A wrong answer close to ``value``: its last two digits made up."""
    while (wrong := value - value % 100 + int(rng.integers(100))) == value:
        pass
    return wrong


def demonstration(
    problem: CalcProblem, rng: np.random.Generator, tool_rates: dict[str, float] | None = None
) -> dict[str, Any]:
    """A chat record (``messages``, ``tools``) that solves ``problem`` with the calculator
    tool or guesses (see the module docstring)."""
    from strop.agents.calculator import calculate

    rates = {**TOOL_RATES, **(tool_rates or {})}
    env = _environment()
    messages: list[dict[str, Any]] = env.reset(problem.to_record())
    if rng.random() < rates["careful" if problem.careful else "casual"]:
        call = {"name": "calculate", "arguments": {"expression": problem.expression}}
        result = calculate(problem.expression)
        assert result == str(problem.value), (problem, result)
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "name": "calculate", "content": result},
            {"role": "assistant", "content": f"#### {result}"},
        ]  # fmt: skip
    else:
        messages.append({"role": "assistant", "content": f"#### {guess(problem.value, rng)}"})
    return {"messages": messages, "tools": env.tool_schemas}


@cache
def _environment() -> Any:
    """One calculator environment to open demonstrations with (making one builds its tool)."""
    from strop.agents.calculator import calculator_environment

    return calculator_environment()


def write_calc_splits(
    out_dir: str | os.PathLike,
    seed: int,
    n_train: int,
    n_validation: int,
    *,
    demonstrations: bool = False,
    tool_rates: dict[str, float] | None = None,
    overwrite: bool = True,
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``validation.jsonl`` (correct answers) into ``out_dir``,
    and with ``demonstrations`` ``sft.jsonl``: one flawed demonstration per train problem
    (:func:`demonstration`). Returns the paths by split name; ``out_dir`` appears only when
    every file is complete."""
    for kind, rate in (tool_rates or {}).items():
        if kind not in TOOL_RATES or not 0.0 <= rate <= 1.0:
            raise ConfigError(
                f"tool_rates takes 'careful' and 'casual' in [0, 1], got {kind}={rate}"
            )
    train, validation = calc_splits(seed, n_train, n_validation)
    files = {
        "train": [p.to_record() for p in train],
        "validation": [p.to_record() for p in validation],
    }
    if demonstrations:
        rng = np.random.default_rng([seed, 13])
        files["sft"] = [demonstration(p, rng, tool_rates) for p in train]
    out = Path(out_dir)
    with atomic_directory(out, overwrite=overwrite) as staging:
        for name, records in files.items():
            lines = "".join(json.dumps(record) + "\n" for record in records)
            (staging / f"{name}.jsonl").write_text(lines, encoding="utf-8")
    return {name: out / f"{name}.jsonl" for name in files}
