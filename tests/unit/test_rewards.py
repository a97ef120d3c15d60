"""Reward registry, failure containment, answer extraction, the numeric fast path and the
format reward. Nothing here starts a math-verify worker (see test_rewards_pool.py)."""

from __future__ import annotations

import json
import math
import os
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from strop import rewards
from strop.errors import ConfigError, StropError
from strop.rewards import base, math_rewards
from strop.rewards.math_rewards import parse_number

# The shared datasets sit beside the checkout (`../shared`); STROP_GSM8K_DIR overrides,
# and /work/shared is where the team's machines mount them for clones made elsewhere.
GSM8K_DIR = next(
    (
        path
        for path in (
            Path(os.environ.get("STROP_GSM8K_DIR", "/nonexistent")),
            Path(__file__).parents[2] / ".." / "shared" / "datasets" / "gsm8k",
            Path("/work/shared/datasets/gsm8k"),
        )
        if path.is_dir()
    ),
    Path(__file__).parents[2] / ".." / "shared" / "datasets" / "gsm8k",
)


class NoPool:
    """Stands in for the verifier pool where the fast path alone must decide."""

    def verify_many(self, pairs):
        raise AssertionError(f"the fast path should have decided these: {pairs}")


@pytest.fixture
def fast_gsm8k() -> rewards.Reward:
    return rewards.Reward("gsm8k", rewards.MathReward(pool=NoPool()))


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))


# --- registry ---------------------------------------------------------------------------


def test_builtin_names():
    assert {"gsm8k", "math", "format"} <= set(rewards.names())
    assert rewards.names() == sorted(rewards.names())


def test_unknown_name_is_a_config_error_listing_the_known_names():
    with pytest.raises(ConfigError) as info:
        rewards.get("gsm9k")
    assert isinstance(info.value, StropError)
    message = str(info.value)
    assert "gsm9k" in message
    for name in ("gsm8k", "math", "format"):
        assert name in message


def test_get_returns_a_fresh_wrapper_each_time():
    first, second = rewards.get("format"), rewards.get("format")
    assert first is not second
    first(["p"], ["#### 1"])
    assert first.stats.calls == 1 and second.stats.calls == 0


def test_register_and_get_a_custom_reward(scratch_registry):
    @rewards.register("length")
    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    assert "length" in rewards.names()
    assert rewards.get("length")(["p", "p"], ["ab", "abcd"]) == [2.0, 4.0]
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("length")(length)
    rewards.register("length", replace=True)(lambda prompts, completions, **c: [0.0] * len(c))
    with pytest.raises(ValueError, match="non-empty"):
        rewards.register("")


# --- containment ------------------------------------------------------------------------


def test_one_raising_item_scores_zero_and_is_counted(scratch_registry):
    @rewards.register("fragile")
    def fragile(prompts, completions, **columns):
        return [1 / 0 if c == "boom" else 1.0 for c in completions]

    reward = rewards.get("fragile")
    assert reward(["p"] * 3, ["a", "boom", "c"]) == [1.0, 0.0, 1.0]
    assert reward.stats == rewards.RewardStats(calls=1, items=3, timeouts=0, errors=1)


def test_non_finite_scores_are_zeroed_and_counted():
    """(Text and None are refused: test_reward_guards.py.)"""
    returns = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "ok": 0.5}
    reward = rewards.Reward(
        "odd", lambda prompts, completions, **c: [returns[x] for x in completions]
    )
    assert reward(["p"] * 4, list(returns)) == [0.0, 0.0, 0.0, 0.5]
    assert reward.stats.errors == 3
    assert all(isinstance(x, float) for x in reward(["p"], ["ok"]))


@pytest.mark.parametrize(
    ("returns", "said"),
    [
        (lambda n: [1.0], "returned 1 score(s) for 2 completion(s)"),
        (lambda n: [], "returned 0 score(s) for 2 completion(s)"),
        (lambda n: None, "returned None for 2 completion(s)"),
        (lambda n: 1.0, "returned a float for 2 completion(s)"),
        (lambda n: "11", "returned a str for 2 completion(s)"),
        (lambda n: {"a": 1.0, "b": 1.0}, "returned a dict for 2 completion(s)"),
        (lambda n: (x for x in [1.0] * n), "returned a generator for 2 completion(s)"),
    ],
)
def test_a_function_that_breaks_the_contract_is_a_one_line_error(returns, said):
    """Not contained: every batch would score 0 the same way (it was retried item by item)."""
    reward = rewards.Reward("short", lambda prompts, completions, **c: returns(len(completions)))
    with pytest.raises(rewards.RewardError) as info:
        reward(["p", "p"], ["a", "b"])
    assert str(info.value).startswith(f"reward 'short' {said}; a reward function returns")
    assert "\n" not in str(info.value) and isinstance(info.value, ConfigError)


def test_a_wrong_count_after_a_raising_batch_is_an_error_too():
    def fn(prompts, completions, **columns):
        if len(completions) > 1:
            raise RuntimeError("batch failure")
        return [1.0, 1.0]

    with pytest.raises(rewards.RewardError, match="returned 2 score"):
        rewards.Reward("twice", fn, source="m.py:twice")(["p", "p"], ["a", "b"])


def test_tuples_and_arrays_of_scores_are_fine():
    import numpy as np

    for out in ((1, 0.5), np.array([1.0, 0.5])):
        reward = rewards.Reward("r", lambda prompts, completions, out=out, **c: out)
        assert reward(["p", "p"], ["a", "b"]) == [1.0, 0.5]


def test_columns_reach_the_function_aligned_per_item():
    seen = []

    def fn(prompts, completions, **columns):
        seen.append(columns)
        if len(completions) > 1:
            raise RuntimeError("batch failure")
        return [float(columns["answer"][0])]

    reward = rewards.Reward("cols", fn)
    assert reward(["p", "q"], ["a", "b"], answer=[3, 4], extra=("x", "y")) == [3.0, 4.0]
    assert seen[1:] == [{"answer": [3], "extra": ["x"]}, {"answer": [4], "extra": ["y"]}]


def test_usage_mistakes_are_not_contained():
    reward = rewards.get("gsm8k")
    with pytest.raises(ConfigError, match="'answer' column"):
        reward(["p"], ["#### 1"], solution=["1"])
    with pytest.raises(ValueError, match="column 'answer'"):
        reward(["p", "p"], ["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match="prompts"):
        reward(["p"], ["1", "2"], answer=["1", "2"])
    assert reward([], [], answer=[]) == []


def test_stats_metrics_and_deltas():
    stats = rewards.RewardStats(calls=3, items=12, timeouts=2, errors=1)
    assert stats.as_metrics() == {
        "reward/calls": 3.0,
        "reward/items": 12.0,
        "reward/timeouts": 2.0,
        "reward/errors": 1.0,
    }
    assert stats - rewards.RewardStats(calls=1, items=4, timeouts=2) == rewards.RewardStats(
        calls=2, items=8, timeouts=0, errors=1
    )


# --- extraction and the fast path -------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("She pays 3 + 4 = 7 dollars.\n#### 7", "7"),
        ("#### 1 then #### 2 \nbye", "2"),
        ("So the total is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} and later \\boxed{\\frac{a}{b^{2}}}", "\\frac{a}{b^{2}}"),
        ("\\boxed{2} then a cut-off \\boxed{\\frac{1", "2"),
        ("<answer> 42 </answer>", "42"),
        ("<answer>1</answer> ... <answer>x = 5</answer>", "x = 5"),
        ("I think 3 apples, then 12.5, so 1,234 in total.", "1,234"),
        ("The answer is 18.", "18"),
        ("It falls by 3-5 degrees to -10.", "-10"),
        ("no digits here", None),
        ("#### \n the result is 4", "4"),
    ],
)
def test_extract_answer(completion, expected):
    assert rewards.extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        # The answer is read after the thinking block: one inside it does not count.
        ("<think>\nMaybe #### 5? No: \\boxed{6}.\n</think>\n\nIt is 7.", "7"),
        ("<think>\nIt is 6.\n</think>\n\nNo answer here.", None),
        ("<think>#### 5</think>#### 7<think>#### 8</think>then 9", "9"),
        # A generation prompt that opened <think> itself (Qwen3-Thinking-2507): only the
        # closing tag is in the completion.
        ("so 6 ... \n</think>\n\n#### 7", "7"),
        # A thought cut short (max_new_tokens) has no answer, whatever it held so far.
        ("<think>\nFirst 2 + 3 = 5, so #### 5", None),
        ("#### 7 <think> wait, maybe 8", None),
    ],
)
def test_answers_are_read_after_the_thinking_block(completion, expected, fast_gsm8k):
    assert rewards.extract_answer(completion) == expected
    score = 1.0 if expected in ("7", "9") else 0.0
    assert fast_gsm8k(["q"], [completion], answer=[expected or "5"]) == [score]
    format_score = float(completion.endswith("#### 7"))
    assert rewards.get("format")(["q"], [completion]) == [format_score]


def test_extract_gold():
    assert rewards.extract_gold("Some work <<2*3=6>>6.\n#### 1,600") == "1,600"
    assert rewards.extract_gold("so it is $\\boxed{\\dfrac{3}{4}}$") == "\\dfrac{3}{4}"
    assert rewards.extract_gold("  \\sqrt{2} ") == "\\sqrt{2}"
    assert rewards.extract_gold(18) == "18"
    assert rewards.extract_gold("   ") is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("18", Fraction(18)),
        ("18.00", Fraction(18)),
        ("18.", Fraction(18)),
        ("$1,234.50", Fraction(246_9, 2)),
        ("\\$5", Fraction(5)),
        ("-$5", Fraction(-5)),
        ("25%", Fraction(25)),
        ("25\\%", Fraction(25)),
        ("$12$", Fraction(12)),
        ("1{,}000", Fraction(1000)),
        ("1\\,000", Fraction(1000)),
        ("+.5", Fraction(1, 2)),
        ("0.1", Fraction(1, 10)),
        ("1,00", None),
        ("1/2", None),
        ("\\frac{1}{2}", None),
        ("18 apples", None),
        ("x", None),
        ("", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_fast_path_decides_plain_numbers_both_ways(fast_gsm8k):
    completions = ["#### 0.30", "The answer is 0.3.", "\\boxed{3}", "#### $1,000", "25%", "x"]
    golds = ["0.3", "#### 0.3", "0.3", "#### 1000", "#### 25", "#### 1"]
    assert fast_gsm8k(["q"] * 6, completions, answer=golds) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert fast_gsm8k.stats == rewards.RewardStats(calls=1, items=6)


def test_huge_answers_are_not_checked(fast_gsm8k):
    assert fast_gsm8k(["q"], ["\\boxed{" + "x+" * 2000 + "1}"], answer=["1"]) == [0.0]


# --- answers with units -----------------------------------------------------------------

# (completion, gold, gsm8k/math score, format score). The fast path must decide every row:
# a number with a unit or noun after it is graded by the number, right and wrong numbers
# both; an answer in words that is not "<number> <unit>" (a hedge, a qualifier, a sentence,
# two numbers) scores 0. ``format`` wants a bare number, so it gives 0 to every unit.
UNIT_ANSWERS = [
    # a unit or noun after the number: graded by the number
    ("#### 18 dollars", "18", 1.0, 0.0),
    ("#### 17 dollars", "18", 0.0, 0.0),
    ("#### $18/hour", "18", 1.0, 0.0),
    ("#### $17/hour", "18", 0.0, 0.0),
    ("#### \\$18 per hour", "18", 1.0, 0.0),
    ("#### 18 dollars per hour", "18", 1.0, 0.0),
    ("#### 1,000 apples", "1000", 1.0, 0.0),
    ("#### 1,001 apples", "1000", 0.0, 0.0),
    ("#### 5 km.", "5", 1.0, 0.0),
    ("#### 6 km.", "5", 0.0, 0.0),
    ("#### -3 degrees", "-3", 1.0, 0.0),
    ("#### 3 degrees", "-3", 0.0, 0.0),
    ("#### -3°C", "-3", 1.0, 0.0),
    ("#### 18 cookies", "Work <<3*6=18>>18\n#### 18", 1.0, 0.0),
    ("#### 18 eggs", "Work <<3*6=18>>18\n#### 18", 1.0, 0.0),
    ("#### 19 eggs", "Work <<3*6=18>>18\n#### 18", 0.0, 0.0),
    ("#### 18.0 eggs", "18", 1.0, 0.0),
    ("#### 18.5 eggs", "18", 0.0, 0.0),
    ("#### 18cm", "18", 1.0, 0.0),
    ("#### 12 o'clock", "12", 1.0, 0.0),
    ("#### 7 year-olds", "7", 1.0, 0.0),
    ("#### 25 percent", "25", 1.0, 0.0),
    ("#### 2 cups of flour in total", "2", 1.0, 0.0),
    ("#### 18 dollars a day", "18", 1.0, 0.0),
    ("#### 90 km/h", "90", 1.0, 0.0),
    ("#### 1/2 cup", "0.5", 1.0, 0.0),
    ("#### 1/3 cup", "0.5", 0.0, 0.0),
    ("#### 18 dollars", "18 dollars", 1.0, 0.0),
    ("#### 18", "18 dollars", 1.0, 1.0),
    ("#### 17", "18 dollars", 0.0, 1.0),
    ("\\boxed{18 dollars}", "18", 1.0, 0.0),
    ("<answer>17 dollars</answer>", "18", 0.0, 0.0),
    # a scale word right after the number multiplies it
    ("#### 1.5 million dollars", "1500000", 1.0, 0.0),
    ("#### 1.5 million", "1.5", 0.0, 0.0),
    ("#### 3 thousand", "3", 0.0, 0.0),
    ("#### 3 thousand", "3000", 1.0, 0.0),
    # plain numbers: as before
    ("#### 18", "18", 1.0, 1.0),
    ("#### 17", "18", 0.0, 1.0),
    ("#### 18.00", "18", 1.0, 1.0),
    ("#### 1,234", "1234", 1.0, 1.0),
    ("#### -3", "-3", 1.0, 1.0),
    ("#### 18.", "18", 1.0, 0.0),
    ("#### $18", "18", 1.0, 0.0),
    # not "<number> <unit>": ungraded, 0 whatever the gold
    ("#### 18 or 19", "18", 0.0, 0.0),
    ("#### 18 or 19", "19", 0.0, 0.0),
    ("#### 18 and 19", "18", 0.0, 0.0),
    ("#### 18 to 19 dollars", "18", 0.0, 0.0),
    ("#### 18 or more", "18", 0.0, 0.0),
    ("#### 18 at least", "18", 0.0, 0.0),
    ("#### 18 is wrong", "18", 0.0, 0.0),
    ("#### 18 dollars, not 19", "18", 0.0, 0.0),
    ("#### about 18", "18", 0.0, 0.0),
    ("#### approximately 18 dollars", "18", 0.0, 0.0),
    ("#### not 18", "18", 0.0, 0.0),
    ("#### The answer is 18", "18", 0.0, 0.0),
    ("#### 18 dollars and 50 cents", "18.5", 0.0, 0.0),
    ("#### eighteen", "18", 0.0, 0.0),
    ("#### 18 apples because 3 times 6 is 18", "18", 0.0, 0.0),
    ("#### 3 thousand dollars or so", "3000", 0.0, 0.0),
]


@pytest.mark.parametrize(("completion", "gold", "correct", "formatted"), UNIT_ANSWERS)
def test_answers_with_units_are_graded_by_the_number(
    monkeypatch, completion, gold, correct, formatted
):
    monkeypatch.setattr(math_rewards, "default_pool", NoPool)
    for name in ("gsm8k", "math"):
        reward = rewards.get(name)
        assert reward(["q"], [completion], answer=[gold]) == [correct], name
        assert reward.stats == rewards.RewardStats(calls=1, items=1), name
    assert rewards.get("format")(["q"], [completion]) == [formatted]


def test_every_builtin_reward_reading_hashes_is_in_the_units_table():
    # A new built-in reward that reads "####" answers must be added to the table above.
    # Built-in: registered by strop's own modules (other tests register rewards of theirs).
    from strop.rewards.base import _REGISTRY

    builtin = {name for name, (fn, _) in _REGISTRY.items() if fn.__module__.startswith("strop.")}
    assert builtin == {"gsm8k", "math", "format"}


class RecordingPool:
    """A verifier pool that records what reaches it and says every pair differs."""

    def __init__(self):
        self.pairs: list[tuple[str, str]] = []

    def verify_many(self, pairs):
        self.pairs += pairs
        return [rewards.Verdict.NOT_EQUAL] * len(pairs)


@pytest.mark.parametrize(
    ("completion", "gold", "sent"),
    [
        # math, not words: math-verify judges it, as before
        ("#### 3 + 4", "7", ("\\boxed{7}", "\\boxed{3 + 4}")),
        ("#### 18 - 2", "16", ("\\boxed{16}", "\\boxed{18 - 2}")),
        ("#### x = 18", "18", ("\\boxed{18}", "\\boxed{x = 18}")),
        ("#### 18 \\text{ dollars}", "18", ("\\boxed{18}", "\\boxed{18 \\text{ dollars}}")),
        # one letter may be a variable or a constant, not a unit
        ("#### 2i", "2", ("\\boxed{2}", "\\boxed{2i}")),
        ("#### 5 x", "5", ("\\boxed{5}", "\\boxed{5 x}")),
        ("#### 1e5", "100000", ("\\boxed{100000}", "\\boxed{1e5}")),
        # a gold math-verify must read: the answer goes without its unit
        ("#### 1/2 cup", "\\frac{1}{2}", ("\\boxed{\\frac{1}{2}}", "\\boxed{1/2}")),
        ("#### 1.5 million", "\\frac{3}{2}", ("\\boxed{\\frac{3}{2}}", "\\boxed{1500000}")),
        ("#### 18 or 19", "x", ("\\boxed{x}", "\\boxed{18 or 19}")),
    ],
)
def test_math_and_symbolic_answers_still_go_to_math_verify(completion, gold, sent):
    pool = RecordingPool()
    reward = rewards.Reward("math", rewards.MathReward(pool=pool))
    assert reward(["q"], [completion], answer=[gold]) == [0.0]
    assert pool.pairs == [sent]


def _gsm8k_golds() -> list[str]:
    if not GSM8K_DIR.is_dir():
        pytest.skip(f"GSM8K is not in {GSM8K_DIR.resolve()} (shared datasets folder absent)")
    with open(GSM8K_DIR / "test.jsonl") as f:
        return [json.loads(line)["answer"] for line in f]


def _written_like_a_model(value: Decimal) -> list[str]:
    text = f"{value:,}" if abs(value) >= 1000 else str(value)
    return [
        f"Let me add it up. The answer is {text}.",
        f"Step by step...\n#### {text}",
        f"So we get $\\boxed{{{text}}}$.",
        f"In total: {text}.00",
        f"She makes ${text} every day.",
    ]


def test_every_gsm8k_test_answer_scores_through_the_fast_path(fast_gsm8k):
    golds = _gsm8k_golds()
    assert len(golds) > 1000
    prompts, completions, answers, expected = [], [], [], []
    for gold in golds:
        value = Decimal(gold.split("####")[-1].strip().replace(",", ""))
        for right, wrong in zip(
            _written_like_a_model(value), _written_like_a_model(value + 1), strict=True
        ):
            completions += [right, wrong]
            expected += [1.0, 0.0]
        answers += [gold] * 10
        prompts += ["question"] * 10
    start = time.perf_counter()
    scores = fast_gsm8k(prompts, completions, answer=answers)
    elapsed = time.perf_counter() - start
    mismatches = [
        (c, a) for c, a, s, e in zip(completions, answers, scores, expected, strict=True) if s != e
    ]
    assert not mismatches, mismatches[:5]
    assert fast_gsm8k.stats.errors == 0 and fast_gsm8k.stats.timeouts == 0
    assert elapsed < 5.0


# --- format -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("3 + 4 = 7\n#### 7", 1.0),
        ("work\n#### -1,234.5  \n\n", 1.0),
        ("#### 7", 1.0),
        ("work\n#### 7 apples", 0.0),
        ("work\n#### $7", 0.0),
        ("#### 7\nand then more text", 0.0),
        ("The answer is 7.", 0.0),
        ("work\n####", 0.0),
        ("", 0.0),
        ("work ####7", 0.0),
    ],
)
def test_format_reward(completion, score):
    assert rewards.get("format")(["q"], [completion]) == [score]
