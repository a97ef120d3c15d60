"""The training-inference mismatch: its monitor (``mismatch/*`` metrics, every run) and its
correction (``ppo.rollout_correction``), in numpy.

The sampler (a native decode loop, or vLLM) and the trainer compute a token's probability
with different numerics (kernels, dtypes, batch shapes), so the rollouts are slightly
off-policy for the trainer. Per token, with ``old`` the trainer's log-probability of the
sampled token before the update and ``sampled`` the sampler's, the log-ratio is
``d = old - sampled`` (``log pi_old_trainer / pi_sampler``, verl's ``rollout_corr``
convention).

Monitor (:func:`mismatch_metrics`): ``mismatch/kl`` is the k3 estimate of
KL(pi_sampler || pi_trainer) over the sampled tokens, ``exp(d) - d - 1`` averaged over
response tokens (verl's ``rollout_corr/k3_kl``); ``mismatch/abs_logprob_diff_mean`` and
``_max``: ``|d|`` over response tokens. With ``ppo.old_logprobs=recompute`` the core has
both arrays and computes them here over the whole batch; with ``ppo.old_logprobs=sampler``
the trainer's log-probabilities first exist in the policy update's first forward, before
any step, so the backends return the sums :func:`strop.objectives.losses.mismatch_stats` defines
and :func:`first_update_metrics` turns the first mini-batch's into the same metrics.

Correction (:func:`correction_weights`): a per-token array ``rollout_is_weights`` that
multiplies the policy-gradient term of the loss (:func:`strop.objectives.losses.policy_terms`),
fixed for the iteration (the weights depend only on the old and sampled log-probabilities),
so it carries no gradient. The importance ratio at ``level``: ``token``, ``exp(d_t)``;
``sequence``, ``exp(sum_t d_t)`` (the product of the token ratios) on every token of the
row; ``geometric``, ``exp(mean_t d_t)``. Log-ratios are clamped to
``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]`` before ``exp``, so every weight is finite. Modes,
with ``C`` the threshold: ``tis`` (truncated IS), ``min(ratio, C)``; ``mis`` (masked IS),
``ratio`` where ``ratio <= C``, else 0 (the token or row leaves the loss); ``icepop``, 1
where ``1/C <= ratio <= C``, else 0 (no reweighting, only the band). Dropped tokens keep
their place in the loss's normaliser (as TRL's ``vllm_importance_sampling_mode=*_mask``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from strop.objectives.losses import LOG_RATIO_LIMIT
from strop.objectives.ppo import WEIGHTS
from strop.rl.rollout import token_mult_prob_error

MODES: tuple[str, ...] = ("none", "tis", "mis", "icepop")
LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
PREFIX = "mismatch_"
"""The backends' policy stats about the mismatch (:func:`strop.objectives.losses.mismatch_stats`):
not logged as ``policy/*``; the first update's become ``mismatch/*`` in sampler mode."""


def log_ratios(old: np.ndarray, sampled: np.ndarray, mask: np.ndarray, level: str) -> np.ndarray:
    """``[B, L]`` float64: the log importance ratio at ``level`` on each response token
    (the row's sum or mean of ``old - sampled`` on every token of a row for ``sequence`` and
    ``geometric``), clamped to ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]``; 0 off the response."""
    if level not in LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; expected one of {LEVELS}")
    on = np.asarray(mask) > 0
    d = np.where(on, np.asarray(old, np.float64), 0.0) - np.where(
        on, np.asarray(sampled, np.float64), 0.0
    )
    if level == "sequence":
        d = np.broadcast_to(d.sum(axis=1, keepdims=True), d.shape)
    elif level == "geometric":
        d = np.broadcast_to(
            d.sum(axis=1, keepdims=True) / np.maximum(on.sum(1, keepdims=True), 1), d.shape
        )
    return np.where(on, np.clip(d, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), 0.0)


def correction_weights(
    old: np.ndarray,
    sampled: np.ndarray,
    mask: np.ndarray,
    mode: str,
    level: str = "token",
    threshold: float = 2.0,
) -> np.ndarray:
    """The per-token weights ``[B, L]`` float64 of correction ``mode`` (see the module
    docstring); 0 off the response. ``mode`` ``none``: 1 on the response."""
    if mode not in MODES:
        raise ValueError(f"unknown rollout correction {mode!r}; expected one of {MODES}")
    on = np.asarray(mask) > 0
    if mode == "none":
        return on.astype(np.float64)
    ratio = np.exp(log_ratios(old, sampled, mask, level))
    if mode == "tis":
        weights = np.minimum(ratio, threshold)
    elif mode == "mis":
        weights = np.where(ratio <= threshold, ratio, 0.0)
    else:  # icepop
        weights = ((ratio >= 1.0 / threshold) & (ratio <= threshold)).astype(np.float64)
    return np.where(on, weights, 0.0)


def mismatch_metrics(old: np.ndarray, sampled: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """``mismatch/kl`` (k3 of KL(sampler || trainer)), ``mismatch/abs_logprob_diff_mean``
    and ``_max`` over the response tokens of ``mask``; none without a response token."""
    on = np.asarray(mask) > 0
    if not on.any():
        return {}
    d = np.asarray(old, np.float64)[on] - np.asarray(sampled, np.float64)[on]
    clamped = np.clip(d, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return {
        "mismatch/kl": float((np.exp(clamped) - clamped - 1.0).mean()),
        "mismatch/abs_logprob_diff_mean": float(np.abs(d).mean()),
        "mismatch/abs_logprob_diff_max": float(np.abs(d).max()),
    }


def weight_metrics(weights: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """``mismatch/is_weight_mean`` and ``mismatch/masked_fraction`` (the share of response
    tokens a correction drops) over the response tokens of ``mask``."""
    on = np.asarray(mask) > 0
    if not on.any():
        return {}
    w = np.asarray(weights, np.float64)[on]
    return {
        "mismatch/is_weight_mean": float(w.mean()),
        "mismatch/masked_fraction": float((w == 0).mean()),
    }


def first_update_metrics(stats: Mapping[str, float]) -> dict[str, float]:
    """The ``mismatch/*`` metrics from a policy update's sums (``mismatch_tokens``,
    ``mismatch_k3_sum``, ``mismatch_abs_diff_sum``, ``mismatch_abs_diff_max``: see
    :func:`strop.objectives.losses.mismatch_stats`); none when it had no response token. Honest
    only for the first update of an iteration in sampler mode (the policy is the sampler's)."""
    tokens = stats.get(f"{PREFIX}tokens", 0.0)
    if not tokens:
        return {}
    return {
        "mismatch/kl": stats[f"{PREFIX}k3_sum"] / tokens,
        "mismatch/abs_logprob_diff_mean": stats[f"{PREFIX}abs_diff_sum"] / tokens,
        "mismatch/abs_logprob_diff_max": stats[f"{PREFIX}abs_diff_max"],
    }


def correct(
    arrays: dict[str, np.ndarray], old: np.ndarray, sampled: np.ndarray, ppo
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The iteration's update arrays and ``mismatch/*`` metrics, with ``old`` (the
    trainer's recomputed log-probabilities) and ``sampled`` (the sampler's), both ``[B, L]``
    over ``arrays["response_mask"]``: the gap always (``token_mult_prob_error`` too), and with ``ppo.rollout_correction``
    on, the weights array (:data:`WEIGHTS`) added and their metrics."""
    mask = arrays["response_mask"]
    error = token_mult_prob_error(sampled, old, mask)
    metrics = {"token_mult_prob_error": error, **mismatch_metrics(old, sampled, mask)}
    if ppo.rollout_correction == "none":
        return arrays, metrics
    weights = correction_weights(
        old, sampled, mask, ppo.rollout_correction, ppo.rollout_correction_level,
        ppo.rollout_correction_threshold,
    )  # fmt: skip
    return {**arrays, WEIGHTS: weights.astype(np.float32)}, {
        **metrics,
        **weight_metrics(weights, mask),
    }
