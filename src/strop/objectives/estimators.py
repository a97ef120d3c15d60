"""Critic-free advantage estimators, in numpy: the oracle both backends' runs are held to.

``ppo.advantage_estimator`` picks how an iteration's rewards become advantages:

- ``gae`` (default): a learned critic's values and GAE (:mod:`strop.objectives.gae`).
- ``grpo`` (Shao et al. 2024, DeepSeekMath): the ``G = ppo.num_generations_per_prompt``
  responses to one prompt form a group; a response's advantage is its score minus the
  group's mean, divided by the group's standard deviation (unbiased, as TRL and verl
  compute it) plus ``GROUP_EPS``, the same for every token of the response.
  ``ppo.grpo_std_normalize: false`` is Dr. GRPO (Liu et al. 2025): no division.
- ``rloo`` (Ahmadian et al. 2024): score minus the mean of the *other* ``G - 1`` responses
  to the same prompt, on every token.
- ``reinforce_pp`` (REINFORCE++, Hu 2025): token rewards as PPO's (the score on the last
  response token, minus ``kl_coef`` times the per-token KL when the KL is in the reward),
  discounted returns (``gamma``) as advantages, whitened over the whole batch.

Rows are laid out prompt-major, as the PPO loop samples them: rows ``g*G .. g*G + G - 1``
are the responses to prompt ``g``. A group whose scores are all equal has zero
advantage under ``grpo`` and ``rloo``: it carries no signal, and
:func:`equal_score_groups` counts such groups for the metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from strop.objectives import gae

GROUP_EPS = 1e-6


def groups(scores: np.ndarray, group_size: int) -> np.ndarray:
    """``scores [B]`` as ``[B / G, G]`` float64, one row per prompt."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1 or group_size < 1 or len(scores) % group_size:
        raise ValueError(f"{scores.shape} scores do not split into groups of {group_size}")
    return scores.reshape(-1, group_size)


def grpo(scores: np.ndarray, group_size: int, std_normalize: bool = True) -> np.ndarray:
    """GRPO's per-response advantages ``[B]`` (Dr. GRPO with ``std_normalize=False``)."""
    if group_size < 2:
        raise ValueError("grpo needs at least 2 responses per prompt")
    grouped = groups(scores, group_size)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if std_normalize:
        centred = centred / (grouped.std(axis=1, ddof=1, keepdims=True) + GROUP_EPS)
    return centred.reshape(-1)


def rloo(scores: np.ndarray, group_size: int) -> np.ndarray:
    """RLOO's per-response advantages ``[B]``: ``r_i - mean(r_j, j != i)``."""
    if group_size < 2:
        raise ValueError("rloo needs at least 2 responses per prompt")
    grouped = groups(scores, group_size)
    others = (grouped.sum(axis=1, keepdims=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def reinforce_pp(
    scores: np.ndarray,
    mask: np.ndarray,
    gamma: float,
    kl: np.ndarray | None = None,
    kl_coef: float = 0.0,
) -> np.ndarray:
    """REINFORCE++'s token advantages ``[B, L]``: whitened discounted returns of the
    token rewards (KL penalty included when ``kl`` is given), 0 off the response."""
    rewards = gae.token_rewards(np.asarray(scores, np.float64), mask, kl=kl, kl_coef=kl_coef)
    returns = gae.gae(rewards, np.zeros_like(rewards), mask, gamma, lam=1.0)
    return gae.masked_whiten(returns, mask)


def on_response_tokens(advantages: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per-response advantages ``[B]`` on each of the row's response tokens ``[B, L]``."""
    return np.asarray(advantages, np.float64)[:, None] * (np.asarray(mask) > 0)


def equal_score_groups(scores: np.ndarray, group_size: int) -> int:
    """How many prompts' responses all scored the same (zero advantage under grpo/rloo)."""
    grouped = groups(scores, group_size)
    return int(np.sum(np.all(grouped == grouped[:, :1], axis=1)))


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered advantage estimator and its declared needs.

    ``fn(scores, mask, *, group_size, gamma, std_normalize, kl, kl_coef) -> [B, L]``: a
    critic-free estimator's token advantages (``kl``: the per-token KL when it is in the
    reward, else None); ``None`` for ``gae``, which the PPO loop computes from the critic's
    values (:mod:`strop.objectives.gae`). ``needs_critic``: a value model is built and trained.
    ``grouped``: it compares the responses to one prompt, so it needs
    ``ppo.num_generations_per_prompt >= 2`` and scores whole responses (its KL goes in the
    loss, as verl's and TRL's GRPO put it)."""

    fn: Callable[..., np.ndarray] | None
    needs_critic: bool = False
    grouped: bool = False


def _grpo(scores, mask, *, group_size, std_normalize, **_):
    return on_response_tokens(grpo(scores, group_size, std_normalize), mask)


def _rloo(scores, mask, *, group_size, **_):
    return on_response_tokens(rloo(scores, group_size), mask)


def _reinforce_pp(scores, mask, *, gamma, kl, kl_coef, **_):
    return reinforce_pp(scores, mask, gamma, kl=kl, kl_coef=kl_coef)


ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(None, needs_critic=True),
    "grpo": AdvantageEstimator(_grpo, grouped=True),
    "rloo": AdvantageEstimator(_rloo, grouped=True),
    "reinforce_pp": AdvantageEstimator(_reinforce_pp),
}
"""The advantage estimators' registry (``ppo.advantage_estimator``): a name ->
:class:`AdvantageEstimator`. The config's allowed values and cross-checks come from here."""


def token_advantages(
    estimator: str,
    scores: np.ndarray,
    mask: np.ndarray,
    *,
    group_size: int,
    gamma: float = 1.0,
    std_normalize: bool = True,
    kl: np.ndarray | None = None,
    kl_coef: float = 0.0,
) -> np.ndarray:
    """``[B, L]`` advantages of a critic-free ``estimator`` (``kl`` only for
    ``reinforce_pp``, whose rewards carry the KL penalty)."""
    entry = ESTIMATORS.get(estimator)
    if entry is None or entry.fn is None:
        free = tuple(name for name, e in ESTIMATORS.items() if e.fn is not None)
        raise ValueError(f"{estimator!r} is not a critic-free estimator; expected one of {free}")
    return entry.fn(
        scores, mask, group_size=group_size, gamma=gamma, std_normalize=std_normalize,
        kl=kl, kl_coef=kl_coef,
    )  # fmt: skip
