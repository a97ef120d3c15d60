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

Correction (``ppo.rollout_correction``, the registry and weights of
:mod:`strop.objectives.corrections`): per-token weights computed once per iteration
from the fixed old and sampled log-probabilities (so they carry no gradient). :func:`correct`
sends them to the update as one more array, ``rollout_is_weights``, which multiplies the
policy-gradient term of the loss (:func:`strop.objectives.losses.policy_terms`), or, for a
rejecting mode (``reject``), takes the rejected tokens out of the response mask the
update's loss weights come from.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from strop.objectives.corrections import CORRECTIONS, correction_weights
from strop.objectives.losses import LOG_RATIO_LIMIT
from strop.objectives.ppo import WEIGHTS
from strop.rl.rollout import token_mult_prob_error

PREFIX = "mismatch_"
"""The backends' policy stats about the mismatch (:func:`strop.objectives.losses.mismatch_stats`):
not logged as ``policy/*``; the first update's become ``mismatch/*`` in sampler mode."""


def at_rollout_temperature(
    sampled: np.ndarray,
    trainer: np.ndarray,
    trainer_at: np.ndarray,
    at: float,
    temperature: float,
) -> np.ndarray:
    """The sampler's log-probabilities ``[B, L]`` (float64) of the untruncated distribution
    at the rollout ``temperature`` T, from its ``sampled`` ones at the temperature ``at``
    (vLLM's ``raw_logprobs``, at 1, where top-k/top-p cut at another temperature), with the
    trainer's at both (``trainer``: at T, the old log-probabilities; ``trainer_at``: at
    ``at``).

    ``log p_T(x) = (at / T) log p_at(x) - log sum_v p_at(v)^(at / T)``: the sum needs the
    whole distribution, which the sampler does not return, so the trainer's stands in for
    it: ``trainer + (at / T) (sampled - trainer_at)``. A sampler computing as the trainer
    does then reads 0 against it at every temperature, as the native samplers do, whatever
    top-k/top-p cut; a gap is the untruncated distributions' at ``at``, times ``at / T``."""
    scale = at / temperature
    trainer, trainer_at = np.asarray(trainer, np.float64), np.asarray(trainer_at, np.float64)
    return trainer + scale * (np.asarray(sampled, np.float64) - trainer_at)


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
    over ``arrays["response_mask"]``: the gap always (``token_mult_prob_error`` too), and
    with ``ppo.rollout_correction`` on, its weights' metrics and either the weights array
    (:data:`WEIGHTS`) added or, for a rejecting mode, the rejected tokens taken out of
    ``response_mask`` (so out of every loss and its normaliser, as verl's ``rollout_rs``)."""
    mask = arrays["response_mask"]
    error = token_mult_prob_error(sampled, old, mask)
    metrics = {"token_mult_prob_error": error, **mismatch_metrics(old, sampled, mask)}
    if ppo.rollout_correction == "none":
        return arrays, metrics
    weights = correction_weights(
        old, sampled, mask, ppo.rollout_correction, ppo.rollout_correction_level,
        ppo.rollout_correction_bounds,
    )  # fmt: skip
    metrics.update(weight_metrics(weights, mask))
    if CORRECTIONS[ppo.rollout_correction].rejects:
        return {
            **arrays,
            "response_mask": np.where(weights > 0, mask, 0).astype(mask.dtype),
        }, metrics
    return {**arrays, WEIGHTS: weights.astype(np.float32)}, metrics
