"""PPO loss conventions, shared by the core and both backends, and the loss pieces the core
computes itself in numpy: the per-token KL estimate (for the reward) and the critic's
explained variance.

The differentiable, float32 per-token terms the PPO steps train with are written once
here (:func:`policy_terms`, :func:`value_terms`) over a backend's :class:`ArrayOps`;
``strop.backends.jax.losses`` and ``strop.backends.torch.losses`` bind them to their own
arrays. ``tests/losses_reference.py`` is their float64 numpy reference. Inputs are ``[B, L]`` in the teacher-forcing layout of
:mod:`strop.rl.gae` (column ``t`` is about emitting ``x_t``; ``mask[b, t] = 1`` marks
response tokens); ``docs/ppo.md`` has each formula.

Shared conventions (numpy, JAX and torch alike):

- Log-ratios ``a - b`` are clamped to ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]`` before
  ``exp`` (k3 and the policy ratio), so one absurd token cannot make ``inf``/``NaN``.
- Every per-token KL value (k1, k2, k3) is bounded to ``[-KL_VALUE_LIMIT,
  KL_VALUE_LIMIT]`` (verl's ``kl_penalty`` clamps only k3 so), so one token the
  reference finds absurd cannot swamp a reward or a loss (k3 at a log-ratio of -15 is
  ``e^15 - 16 = 3.3e6``). Where the bound is in force the token's KL has no gradient.
- Masked-out columns are selected away (``where``) before any non-linear op, never
  multiplied by 0, so whatever they hold (NaN and Inf included) reaches neither a result
  nor, in the backends, a gradient (the gradient of ``where(m, f(x), 0)`` is NaN where
  ``f'(x)`` is, so the inputs themselves are selected first).
- A loss is a weighted sum of per-token terms under the loss weights of
  :func:`strop.rl.objectives.aggregation_weights` (``token_mean``, ``sequence_mean`` or
  Dr. GRPO's ``seq_mean_token_sum_norm``); over no response token it is 0, not NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

KlEstimator = Literal["k1", "k2", "k3"]
Aggregation = Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
AGGREGATIONS: tuple[str, ...] = ("token_mean", "sequence_mean")
# Dr. GRPO's constant normaliser needs the response-length budget: the PPO loop reaches it
# through loss weights (strop.rl.objectives.aggregation_weights), which take the horizon.
CONSTANT_NORMALISED = "seq_mean_token_sum_norm"
LOG_RATIO_LIMIT = 20.0
KL_VALUE_LIMIT = 10.0


def check_estimator(estimator: str) -> None:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def check_aggregation(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")


def check_dual_clip(dual_clip: float | None) -> None:
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")


def kl_estimate(log_ratio, estimator: KlEstimator, xp):
    """Per-token KL(pi || ref) estimate from ``log_ratio = logprobs - ref_logprobs``, with
    the array module ``xp`` (``numpy``, ``jax.numpy`` or ``torch``: its ``clip``, ``exp``).

    With ``d`` the log-ratio clamped to ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]``:
    ``k1 = d``; ``k2 = d^2 / 2``; ``k3 = exp(-d) + d - 1`` (Schulman's estimator, unbiased
    and non-negative). Each value is then bounded to ``[-KL_VALUE_LIMIT, KL_VALUE_LIMIT]``.
    """
    check_estimator(estimator)
    d = xp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = xp.exp(-d) + d - 1.0
    return xp.clip(kl, -KL_VALUE_LIMIT, KL_VALUE_LIMIT)


def kl_penalty(
    logprobs: np.ndarray, ref_logprobs: np.ndarray, estimator: KlEstimator
) -> np.ndarray:
    """Per-token estimate ``[B, L]`` of KL(pi || ref) from the sampled tokens' log-probs, in
    float64 (:func:`kl_estimate`). Not masked: the caller aggregates or puts it in rewards.
    """
    log_ratio = np.asarray(logprobs, np.float64) - np.asarray(ref_logprobs, np.float64)
    return kl_estimate(log_ratio, estimator, np)


def explained_variance(values: np.ndarray, returns: np.ndarray, mask: np.ndarray) -> float:
    """``1 - var(R - V) / var(R)`` over response tokens (biased variances).

    1 is a perfect critic, 0 one no better than the mean return, negative worse than
    that. NaN when the returns have no variance (or there are no response tokens).
    """
    on = np.asarray(mask) > 0
    if not on.any():
        return float("nan")
    r = np.asarray(returns, np.float64)[on]
    v = np.asarray(values, np.float64)[on]
    var_r = r.var()
    if var_r == 0:
        return float("nan")
    return float(1.0 - (r - v).var() / var_r)


@dataclass(frozen=True)
class ArrayOps:
    """A backend's array primitives, over which :func:`policy_terms` and :func:`value_terms`
    are written once for both backends (differentiable, float32).

    ``xp``: ``jax.numpy`` or ``torch`` (its ``clip``, ``exp``, ``maximum``, ``minimum``,
    ``where``, ``zeros_like``); ``on(mask)``: the boolean response mask; ``select(on, x)``:
    ``x`` as float32 where ``on``, else 0; ``indicator(b)``: a boolean array as float32.
    """

    xp: Any
    on: Callable[[Any], Any]
    select: Callable[[Any, Any], Any]
    indicator: Callable[[Any], Any]


def policy_terms(
    ops: ArrayOps,
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    is_weights=None,
) -> tuple[Any, dict[str, Any]]:
    """Per-token clipped-surrogate loss ``[B, L]`` and per-token statistics (``clipfrac``
    and ``dual_clip_frac`` indicators, ``approx_kl``), before any aggregation; all 0 where
    ``mask`` is 0, whatever the inputs hold there (NaN and Inf included).

    ``is_weights``: a rollout correction's per-token weights
    (:mod:`strop.rl.rollout_correction`, finite, no gradient), multiplied into the loss
    term; the tokens they drop (weight 0) are selected away, not multiplied by 0."""
    check_dual_clip(dual_clip)
    xp = ops.xp
    on = ops.on(mask)
    log_ratio = ops.select(on, logprobs) - ops.select(on, old_logprobs)
    ratio = xp.exp(xp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    adv = ops.select(on, advantages)
    pg1 = -adv * ratio
    pg2 = -adv * xp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = xp.maximum(pg1, pg2)
    terms = {"clipfrac": ops.indicator(pg2 > pg1), "approx_kl": 0.5 * log_ratio * log_ratio}
    loss = clipped
    if dual_clip is not None:
        bound = -adv * dual_clip
        terms["dual_clip_frac"] = ops.indicator((adv < 0) & (clipped > bound))
        loss = xp.where(adv < 0, xp.minimum(clipped, bound), clipped)
    if is_weights is not None:
        weights = ops.select(on, is_weights)
        loss = xp.where(weights > 0, loss * weights, xp.zeros_like(loss))
    return loss, terms


MAX_STATS = frozenset({"mismatch_abs_diff_max"})
"""Update stats reduced by ``max`` over micro-batches and ranks (every other one is a sum)."""


def mismatch_stats(ops: ArrayOps, logprobs, old_logprobs, mask) -> dict[str, Any]:
    """Unweighted sums over the response tokens of ``mask`` (whatever the loss's
    aggregation), for the training-inference mismatch monitor
    (:func:`strop.rl.rollout_correction.first_update_metrics`), with ``d = logprobs -
    old_logprobs``: ``mismatch_tokens`` (the count), ``mismatch_k3_sum`` (``exp(d) - d -
    1``, ``d`` clamped), ``mismatch_abs_diff_sum`` and ``mismatch_abs_diff_max`` (``|d|``).
    0-d arrays; 0 on a micro-batch without a response token."""
    xp = ops.xp
    on = ops.on(mask)
    d = ops.select(on, logprobs) - ops.select(on, old_logprobs)
    clamped = xp.clip(d, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    absolute = xp.abs(d)
    return {
        "mismatch_tokens": ops.indicator(on).sum(),
        "mismatch_k3_sum": (xp.exp(clamped) - clamped - 1.0).sum(),
        "mismatch_abs_diff_sum": absolute.sum(),
        "mismatch_abs_diff_max": absolute.max(),
    }


def value_terms(
    ops: ArrayOps, values, old_values, returns, mask, value_clip: float | None
) -> tuple[Any, Any]:
    """Per-token ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`` ``[B, L]`` and the
    per-token indicator that the clipped branch won; ``value_clip`` 0/None: no clipping.
    Both are 0 where ``mask`` is 0, whatever the inputs hold there."""
    xp = ops.xp
    on = ops.on(mask)
    v, r = ops.select(on, values), ops.select(on, returns)
    unclipped = (v - r) ** 2
    if not value_clip:
        return 0.5 * unclipped, xp.zeros_like(v)
    old = ops.select(on, old_values)
    clipped = (xp.clip(v, old - value_clip, old + value_clip) - r) ** 2
    return 0.5 * xp.maximum(unclipped, clipped), ops.indicator(clipped > unclipped)
