"""Synthetic GSM8K-style problems: deterministic, correct arithmetic, readable by strop.data."""

from __future__ import annotations

import json
import operator
import re

import pytest

from strop import rewards
from strop.data import read_examples
from strop.data.synthetic import MAX_VALUE, make_problems, write_splits
from strop.errors import ConfigError

LINE = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def solve(answer: str) -> tuple[int, int, int]:
    """Recompute a worked solution on its own: (number of steps, computed result, the
    number after ``####``); each line must start from the previous line's result."""
    *lines, final = answer.split("\n")
    assert final.startswith("#### ")
    value = None
    for line in lines:
        match = LINE.fullmatch(line)
        assert match, line
        left, op, right, stated = match.groups()
        if value is not None:
            assert int(left) == value, answer
        value = OPERATORS[op](int(left), int(right))
        assert value == int(stated), line
    assert value is not None
    return len(lines), value, int(final.removeprefix("#### "))


def test_same_seed_same_problems_other_seed_other_problems():
    assert make_problems(50, seed=3) == make_problems(50, seed=3)
    assert make_problems(50, seed=3) != make_problems(50, seed=4)
    assert make_problems(20, seed=3) == make_problems(50, seed=3)[:20]


def test_every_answer_is_its_arithmetic():
    records = make_problems(600, seed=0)
    steps = set()
    for record in records:
        assert set(record) == {"question", "answer"}
        count, computed, final = solve(record["answer"])
        assert computed == final
        assert 0 <= final < MAX_VALUE
        for number in map(int, re.findall(r"\d+", record["answer"])):
            assert 0 <= number < MAX_VALUE
        steps.add(count)
        assert record["question"].endswith("?")
    assert steps == {1, 2, 3}
    assert len({r["question"] for r in records}) == len(records)


def test_max_steps_bounds_the_steps():
    assert {solve(r["answer"])[0] for r in make_problems(100, seed=1, max_steps=1)} == {1}
    assert {solve(r["answer"])[0] for r in make_problems(100, seed=1, max_steps=2)} == {1, 2}
    with pytest.raises(ConfigError, match="max_steps"):
        make_problems(1, seed=0, max_steps=4)


def test_the_question_states_every_operand():
    for record in make_problems(200, seed=2):
        numbers = set(re.findall(r"\d+", record["question"]))
        for line in record["answer"].split("\n")[:-1]:
            right = LINE.fullmatch(line).group(3)
            assert right in numbers
        first = LINE.fullmatch(record["answer"].split("\n")[0]).groups()[0]
        assert first in numbers


def test_gsm8k_reward_scores_the_gold_one_and_a_wrong_answer_zero():
    records = make_problems(40, seed=5)
    reward = rewards.get("gsm8k")
    golds = [r["answer"] for r in records]
    assert reward([""] * 40, golds, answer=golds) == [1.0] * 40
    wrong = [f"{g.rsplit('#### ', 1)[0]}#### {solve(g)[2] + 1}" for g in golds]
    assert reward([""] * 40, wrong, answer=golds) == [0.0] * 40
    assert reward.stats.timeouts == reward.stats.errors == 0


def test_splits_are_disjoint_deterministic_and_read_as_gsm8k(tmp_path):
    paths = write_splits(tmp_path / "a", seed=7, n_train=300, n_validation=100)
    again = write_splits(tmp_path / "b", seed=7, n_train=300, n_validation=100)
    assert set(paths) == {"train", "validation"}
    for name in paths:
        assert paths[name].read_bytes() == again[name].read_bytes()

    def questions(path):
        return {json.loads(line)["question"] for line in path.read_text().splitlines()}

    train, validation = questions(paths["train"]), questions(paths["validation"])
    assert len(train) == 300 and len(validation) == 100
    assert not train & validation

    # The validation split does not depend on the size of the train split.
    other = write_splits(tmp_path / "c", seed=7, n_train=50, n_validation=100)
    assert other["validation"].read_bytes() == paths["validation"].read_bytes()

    examples, stats = read_examples(paths["validation"])
    assert stats.format == "gsm8k" and stats.num_records == 100
    first = json.loads(paths["validation"].read_text().splitlines()[0])
    assert examples[0].prompt == f"Question: {first['question']}\nAnswer:"
    assert examples[0].completion == " " + first["answer"]
    assert examples[0].reference == str(solve(first["answer"])[2])


def test_early_answer_fraction_flaws_only_multi_step_train_answers(tmp_path):
    clean = write_splits(tmp_path / "clean", seed=0, n_train=3000, n_validation=50)
    noisy = write_splits(
        tmp_path / "noisy", seed=0, n_train=3000, n_validation=50, early_answer_fraction=0.7
    )
    assert noisy["validation"].read_text() == clean["validation"].read_text()
    flawed = multi_step = 0
    for a, b in zip(
        clean["train"].read_text().splitlines(),
        noisy["train"].read_text().splitlines(),
        strict=True,
    ):
        good, bad = json.loads(a), json.loads(b)
        assert bad["question"] == good["question"]
        count, _, final = solve(good["answer"])
        good_lines, bad_lines = good["answer"].split("\n"), bad["answer"].split("\n")
        assert bad_lines[:-1] == good_lines[:-1]  # every step still worked out correctly
        first_result = int(LINE.fullmatch(good_lines[0]).group(4))
        assert int(bad_lines[-1].removeprefix("#### ")) in (final, first_result)
        multi_step += count > 1
        flawed += bad != good
    assert 0.65 < flawed / multi_step < 0.75


def test_early_answer_fraction_out_of_range_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="early_answer_fraction"):
        write_splits(tmp_path / "x", seed=0, n_train=10, n_validation=5, early_answer_fraction=1.5)
