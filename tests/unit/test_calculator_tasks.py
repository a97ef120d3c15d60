"""strop.agents.calculator_tasks: seeded calculator problems and flawed tool-use demonstrations."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strop.agents.calculator import SYSTEM_PROMPT, calculate, correct
from strop.agents.calculator_tasks import (
    TOOL_RATES,
    calc_splits,
    demonstration,
    make_calc_problems,
    write_calc_splits,
)
from strop.data.sources import read_examples
from strop.errors import ConfigError


def test_the_same_seed_writes_the_same_files_and_another_seed_others(tmp_path) -> None:
    files = [
        write_calc_splits(tmp_path / name, seed, 300, 40, demonstrations=True)
        for name, seed in (("a", 5), ("b", 5), ("c", 6))
    ]
    for split in ("train", "validation", "sft"):
        a, b, c = (f[split].read_bytes() for f in files)
        assert a == b and a != c
    # The validation split does not depend on n_train; the splits are disjoint.
    train, validation = calc_splits(5, 10, 40)
    assert [p.to_record() for p in validation] == [
        json.loads(line) for line in files[0]["validation"].read_text().splitlines()
    ]
    assert not {p.question for p in train} & {p.question for p in validation}


def test_problems_are_products_with_the_right_gold(tmp_path) -> None:
    problems = make_calc_problems(400, 1)
    assert len({p.question for p in problems}) == 400
    assert {p.careful for p in problems} == {True, False}
    for p in problems:
        assert "*" in p.expression and calculate(p.expression) == str(p.value)
        answer = [{"role": "assistant", "content": f"#### {p.value}"}]
        assert correct(p.to_record(), answer) == {"correct": 1.0}
    paths = write_calc_splits(tmp_path, 1, 20, 5)
    examples, stats = read_examples(paths["validation"])  # GSM8K records strop reads
    _, validation = calc_splits(1, 0, 5)
    assert stats.format == "gsm8k"
    assert [e.reference for e in examples] == [str(p.value) for p in validation]


def test_demonstrations_call_the_tool_by_phrasing_and_guess_wrong_otherwise() -> None:
    problems = make_calc_problems(1000, 2)
    rng = np.random.default_rng(0)
    used = {True: [], False: []}
    for problem in problems:
        record = demonstration(problem, rng)
        messages = record["messages"]
        assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert messages[1] == {"role": "user", "content": problem.question}
        assert [t["function"]["name"] for t in record["tools"]] == ["calculate"]
        gold = problem.to_record()
        score = correct(gold, messages)["correct"]
        if len(messages) == 5:  # the tool path: call, result, answer
            call = messages[2]["tool_calls"][0]["function"]
            assert call == {"name": "calculate", "arguments": {"expression": problem.expression}}
            assert messages[3] == {
                "role": "tool",
                "name": "calculate",
                "content": str(problem.value),
            }
            assert score == 1.0
        else:  # a guess: close, never right
            assert len(messages) == 3 and score == 0.0
            guessed = int(messages[2]["content"].removeprefix("#### "))
            assert guessed // 100 == problem.value // 100
        used[problem.careful].append(len(messages) == 5)
    for careful, kind in ((True, "careful"), (False, "casual")):
        assert np.mean(used[careful]) == pytest.approx(TOOL_RATES[kind], abs=0.05)


def test_bad_tool_rates_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="tool_rates takes 'careful' and 'casual'"):
        write_calc_splits(tmp_path, 0, 2, 2, demonstrations=True, tool_rates={"careful": 2.0})
