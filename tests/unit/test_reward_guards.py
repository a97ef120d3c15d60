"""A reward never fails silently and cannot hang a run: a score of the wrong type stops at
the first call naming the function and the value; NaN/Inf and exceptions score 0, are
counted and warned about once with the first exception; more failures in one call than
``max_reward_error_fraction`` allows stop the run naming the first; a function from a file
or module runs in a worker process with a per-call deadline, past which the worker is
killed and restarted and the error names the reward."""

from __future__ import annotations

import logging
import math
import os
import time
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

from strop import rewards
from strop.config import load_config
from strop.errors import ConfigError
from strop.rewards import RewardError, RewardLimits, RewardTimeoutError

FILE = """
import os, time

def fine(prompts, completions, **columns):
    return [float(len(c)) for c in completions]

def says_yes(prompts, completions, **columns):
    return ["1"] * len(completions)

def needs_solution(prompts, completions, **columns):
    return [float(s == c) for s, c in zip(columns["solution"], completions)]

def sometimes_hangs(prompts, completions, **columns):
    if "hang" in completions:
        time.sleep(600)
    return [1.0] * len(completions)

def crashes(prompts, completions, **columns):
    os._exit(3)

def misuses_gsm8k(prompts, completions, **columns):
    from strop import rewards
    return rewards.get("gsm8k")(prompts, completions)

def _make():
    offset = 0.5
    return lambda prompts, completions, **columns: [offset] * len(completions)

closure = _make()
"""
CONTRACT = "a reward function returns one number (float, int, bool) per completion"


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("guards") / "guarded.py"
    path.write_text(FILE)
    return path


def fails_on_x(prompts, completions, **columns):
    """Reads a column no record has, for completions "x" (a batch with one raises)."""
    return [{}["solution"] if c == "x" else 1.0 for c in completions]


# --- what a function may return ---------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("1", "a str ('1')"),
        ("no", "a str ('no')"),
        (None, "None"),
        ([1.0], "a list ([1.0])"),
        (b"1", "a bytes (b'1')"),
        (np.array([1.0]), "a ndarray (array([1.]))"),
        (1j, "a complex (1j)"),
    ],
)
def test_a_score_of_the_wrong_type_stops_at_the_first_call(value, said):
    reward = rewards.Reward("r", lambda prompts, c, **k: [1.0, value, 0.0], source="m.py:r")
    with pytest.raises(RewardError) as info:
        reward(["p"] * 3, ["a", "b", "c"])
    assert (
        str(info.value) == f"reward 'r' (m.py:r) returned {said} for completion 1 of 3; {CONTRACT}"
    )
    assert reward.stats.calls == 0


@pytest.mark.parametrize(
    "out",
    [
        np.array([True, False]),
        np.array([1.0, 0.0], dtype=np.float32),
        [np.float64(1.0), np.int64(0)],
        [True, 0],
        (Fraction(2, 2), Decimal("0")),
    ],
    ids=["bool-array", "float32-array", "numpy-scalars", "bool-int", "fraction-decimal"],
)
def test_numbers_of_every_kind_are_scores(out):
    reward = rewards.Reward("r", lambda prompts, completions, **c: out)
    scores = reward(["p", "p"], ["a", "b"])
    assert scores == [1.0, 0.0] and all(type(s) is float for s in scores)
    assert reward.stats.errors == 0


# --- failures are counted, warned about once, and too many stop the run ----------------


def test_the_first_failure_is_a_warning_with_its_exception(caplog):
    reward = rewards.Reward("r", fails_on_x, source="m.py:r")
    with caplog.at_level(logging.WARNING, logger="strop.rewards.base"):
        assert reward(["p"] * 4, ["a", "x", "c", "d"]) == [1.0, 0.0, 1.0, 1.0]
        assert reward(["p"] * 2, ["x", "b"]) == [0.0, 1.0]
    assert reward.stats.errors == 2
    [record] = caplog.records
    message = record.getMessage()
    assert message.startswith(
        "reward 'r' (m.py:r) failed on 1 of 4 completions (scored 0, counted in "
        "reward/errors; later failures are not warned about): completion 1: "
    )
    line = fails_on_x.__code__.co_firstlineno + 2
    assert message.endswith(f"test_reward_guards.py:{line}: KeyError: 'solution'"), message


def test_nan_and_inf_are_errors_and_warned_about(caplog):
    reward = rewards.Reward("r", lambda prompts, completions, **c: [1.0, math.inf, math.nan])
    with caplog.at_level(logging.WARNING, logger="strop.rewards.base"):
        assert reward(["p"] * 3, ["a", "b", "c"]) == [1.0, 0.0, 0.0]
    assert reward.stats.errors == 2
    assert caplog.records[0].getMessage().endswith(": completion 1: returned inf")


def test_more_failures_than_allowed_stop_the_run_naming_the_first():
    limits = RewardLimits(max_error_fraction=0.5, section="ppo")
    reward = rewards.Reward("r", fails_on_x, source="m.py:r", limits=limits)
    assert reward(["p"] * 4, ["a", "x", "c", "x"]) == [1.0, 0.0, 1.0, 0.0]  # half: allowed
    with pytest.raises(RewardError) as info:
        reward(["p"] * 4, ["a", "x", "x", "x"])
    message = str(info.value)
    assert message.startswith(
        "reward 'r' (m.py:r) failed on 3 of 4 completions, more than "
        "ppo.max_reward_error_fraction=0.5 allows; the first failure: completion 1: "
    )
    assert message.endswith("KeyError: 'solution'") and "\n" not in message
    assert reward.stats.errors == 5  # still counted
    # without a limit (the library's default) nothing stops
    assert rewards.Reward("r", fails_on_x)(["p"] * 2, ["x", "x"]) == [0.0, 0.0]


def test_the_limits_come_from_the_config():
    config = load_config("ppo-lora-tiny", [])
    assert RewardLimits.of(config.ppo, "ppo") == RewardLimits(300.0, 0.5, "ppo")
    assert RewardLimits.of(config.eval, "eval") == RewardLimits(300.0, 0.5, "eval")
    config = load_config("ppo-lora-tiny", ["ppo.reward_timeout_s=0", "eval.reward_timeout_s=null"])
    assert RewardLimits.of(config.ppo, "ppo").timeout_s is None
    assert RewardLimits.of(config.eval, "eval").timeout_s is None
    for bad in ("ppo.reward_timeout_s=-1", "ppo.max_reward_error_fraction=1.5"):
        with pytest.raises(ConfigError):
            load_config("ppo-lora-tiny", [bad])


# --- user functions run in a worker process with a deadline ----------------------------


def test_without_a_deadline_or_for_a_registered_name_it_runs_in_the_trainer(reward_file):
    assert rewards.load(f"{reward_file}:fine").isolated is None
    assert rewards.load(f"{reward_file}:fine", limits=RewardLimits(0.0)).isolated is None
    assert rewards.load("format", limits=RewardLimits(5.0)).isolated is None


def test_a_function_from_a_file_scores_the_same_in_its_worker(reward_file):
    limits = RewardLimits(timeout_s=60, max_error_fraction=0.5, section="ppo")
    ref = f"{reward_file}:fine"
    fine = rewards.load(ref, limits=limits)
    assert fine(["p"] * 2, ["ab", "abcd"], answer=["1", "2"]) == [2.0, 4.0]
    assert fine.isolated.pid() not in (None, os.getpid())
    assert rewards.load(f"{reward_file}:closure", limits=limits)(["p"], ["a"]) == [0.5]

    with pytest.raises(RewardError) as info:  # the worker's result breaks the contract
        rewards.load(f"{reward_file}:says_yes", limits=limits)(["p"], ["a"])
    assert str(info.value) == (
        f"reward 'says_yes' ({reward_file}:says_yes) returned a str ('1') for completion 0 "
        f"of 1; {CONTRACT}"
    )
    needs = rewards.load(f"{reward_file}:needs_solution", limits=limits)
    assert needs(["p"] * 2, ["a", "b"], solution=["a", "c"]) == [1.0, 0.0]
    with pytest.raises(RewardError) as info:  # reads a column the data does not have
        needs(["p"] * 2, ["a", "b"])
    assert str(info.value).endswith(
        f"the first failure: completion 0: {reward_file}:11: KeyError: 'solution'"
    )
    with pytest.raises(ConfigError, match="'answer' column"):  # a StropError inside
        rewards.load(f"{reward_file}:misuses_gsm8k", limits=limits)(["p"], ["#### 1"])


def test_a_worker_that_dies_fails_the_call(reward_file):
    limits = RewardLimits(timeout_s=60, max_error_fraction=0.5, section="eval")
    reward = rewards.load(f"{reward_file}:crashes", limits=limits)
    with pytest.raises(RewardError) as info:
        reward(["p"] * 3, ["a", "b", "c"])
    assert str(info.value).endswith(
        "failed on 3 of 3 completions, more than eval.max_reward_error_fraction=0.5 allows; "
        "the first failure: all 3: its worker process died (exit code 3)"
    )


def test_a_call_past_its_deadline_kills_the_worker_and_names_the_reward(reward_file):
    reward = rewards.load(
        f"{reward_file}:sometimes_hangs", limits=RewardLimits(timeout_s=1.0, section="ppo")
    )
    assert reward(["p"], ["ok"]) == [1.0]  # the worker is up: its start is not charged
    first = reward.isolated.pid()
    began = time.monotonic()
    with pytest.raises(RewardTimeoutError) as info:
        reward(["p"] * 2, ["ok", "hang"])
    assert 1.0 <= time.monotonic() - began < 10
    assert isinstance(info.value, ConfigError)  # one line, exit 2
    assert str(info.value) == (
        f"reward 'sometimes_hangs' ({reward_file}:sometimes_hangs) did not return within "
        "ppo.reward_timeout_s=1 s on 2 completion(s); its worker process was killed. Make it "
        "faster, or raise ppo.reward_timeout_s (0: no deadline, called in the trainer)"
    )
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # killed and reaped
    assert reward(["p"], ["ok"]) == [1.0]  # on a fresh worker
    assert reward.isolated.pid() not in (None, first)
    reward.close()
    assert reward.isolated.pid() is None
