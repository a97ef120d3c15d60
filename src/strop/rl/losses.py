"""PPO loss conventions, shared by the core and both backends, and the loss pieces the core
computes itself in numpy: the per-token KL estimate (for the reward) and the critic's
explained variance.

``strop.backends.jax.losses`` and ``strop.backends.torch.losses`` hold the differentiable,
float32 per-token terms the PPO steps train with; ``tests/losses_reference.py`` is their
float64 numpy reference. Inputs are ``[B, L]`` in the teacher-forcing layout of
:mod:`strop.rl.gae` (column ``t`` is about emitting ``x_t``; ``mask[b, t] = 1`` marks
response tokens); ``docs/ppo.md`` has each formula.

Shared conventions (numpy, JAX and torch alike):

- Log-ratios ``a - b`` are clamped to ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]`` before
  ``exp`` (k3 and the policy ratio), so one absurd token cannot make ``inf``/``NaN``.
- Every per-token KL value (k1, k2, k3) is bounded to ``[-KL_VALUE_LIMIT,
  KL_VALUE_LIMIT]`` (verl's ``kl_penalty`` clamps k3 the same way), so one token the
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

from typing import Literal

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
