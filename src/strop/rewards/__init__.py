"""Verifiable rewards: a registry of reward functions, with math-answer checking built in.

Usage::

    from strop import rewards

    reward = rewards.get("gsm8k")           # a Reward: fresh counters per get()
    scores = reward(prompts, completions, answer=gold_answers)
    metrics.update(reward.stats.as_metrics())  # reward/timeouts, reward/errors, ...

Built in: ``gsm8k`` and ``math`` (answer correctness, exact numbers first, math-verify in a
killable worker pool otherwise; :mod:`strop.rewards.math_rewards`) and ``format`` (the
completion ends in a ``#### N`` line; it needs no gold answer). Add your own with
:func:`register`; pass ``gold=Gold(extract, needs)`` if it compares against a gold answer,
so that data without one is refused before a model loads.

A run's reward (``ppo.reward``, ``eval.reward``) may also be a function of the user's,
``package.module:function`` or ``path/to/file.py:function`` (:mod:`strop.rewards.loading`),
and ``ppo.reward`` a weighted list of rewards (:mod:`strop.rewards.weighted`)::

    reward = rewards.resolve([{"reward": "gsm8k"}, {"reward": "my.py:short", "weight": 0.1}])
    scored = reward.score(prompts, completions, columns)   # .total, .parts, .metrics()

Design: :mod:`strop.rewards.base` has the contract and the :class:`Reward` wrapper that turns
per-item failures into a 0 plus a counted error (and stops a run past
:attr:`RewardLimits.max_error_fraction`); :mod:`strop.rewards.calling` checks what a call
returned; :mod:`strop.rewards.isolated` calls a user's function in a worker process with a
per-call deadline (:attr:`RewardLimits.timeout_s`, :class:`RewardTimeoutError`);
:mod:`strop.rewards.pool` has the :class:`VerifierPool` that runs math-verify under a hard
per-item deadline by killing and replacing the worker process of an item that takes too
long.
"""

from __future__ import annotations

from strop.rewards.base import (
    Gold,
    Reward,
    RewardError,
    RewardFn,
    RewardLimits,
    RewardStats,
    Scores,
    get,
    names,
    register,
)
from strop.rewards.isolated import RewardTimeoutError
from strop.rewards.loading import load
from strop.rewards.math_rewards import MathReward, extract_answer, extract_gold, format_reward
from strop.rewards.pool import PoolStats, Verdict, VerifierPool, default_pool
from strop.rewards.weighted import Component, ScoredBatch, WeightedReward, resolve

__all__ = [
    "Component",
    "Gold",
    "MathReward",
    "PoolStats",
    "Reward",
    "RewardError",
    "RewardFn",
    "RewardLimits",
    "RewardStats",
    "RewardTimeoutError",
    "ScoredBatch",
    "Scores",
    "Verdict",
    "VerifierPool",
    "WeightedReward",
    "default_pool",
    "extract_answer",
    "extract_gold",
    "format_reward",
    "get",
    "load",
    "names",
    "register",
    "resolve",
]
