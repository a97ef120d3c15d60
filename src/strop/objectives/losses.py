"""PPO loss conventions, shared by the core and both backends; the registries of KL
estimators (:data:`KL_ESTIMATORS`) and policy losses (:data:`POLICY_LOSSES`: ``ppo``,
``gspo``, ``cispo``, ``sapo``); and the loss pieces the core computes itself in numpy: the
per-token KL estimate (for the reward) and the critic's explained variance.

The differentiable, float32 per-token terms the PPO steps train with are written once
here (the policy losses, :func:`value_terms`) over a backend's :class:`ArrayOps`;
``strop.backends.jax.losses`` and ``strop.backends.torch.losses`` define their ``OPS``,
with which the backends call them. ``tests/losses_reference.py`` holds their float64 numpy references. Inputs are
``[B, L]`` in the teacher-forcing layout of :mod:`strop.objectives.gae` (column ``t`` is about
emitting ``x_t``; ``mask[b, t] = 1`` marks response tokens); ``docs/ppo.md`` has each
formula.

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
  :func:`strop.objectives.ppo.aggregation_weights` (``token_mean``, ``sequence_mean`` or
  Dr. GRPO's ``seq_mean_token_sum_norm``); over no response token it is 0, not NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

KlEstimator = str  # a name of KL_ESTIMATORS
Aggregation = Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]

AGGREGATIONS: tuple[str, ...] = ("token_mean", "sequence_mean")
# Dr. GRPO's constant normaliser needs the response-length budget: the PPO loop reaches it
# through loss weights (strop.objectives.ppo.aggregation_weights), which take the horizon.
CONSTANT_NORMALISED = "seq_mean_token_sum_norm"
LOG_RATIO_LIMIT = 20.0
KL_VALUE_LIMIT = 10.0


def _k1(d, xp):
    return d


def _k2(d, xp):
    return 0.5 * d * d


def _k3(d, xp):
    return xp.exp(-d) + d - 1.0


KL_ESTIMATORS: dict[str, Callable[[Any, Any], Any]] = {"k1": _k1, "k2": _k2, "k3": _k3}
"""The KL estimators' registry (``ppo.kl_estimator``): a name -> ``f(d, xp)``, the per-token
estimate of KL(pi || ref) from the clamped log-ratio ``d = logp - ref_logp`` with the array
module ``xp``: Schulman's k1 ``d``, k2 ``d^2 / 2``, k3 ``exp(-d) + d - 1`` (unbiased,
non-negative). Add one by adding an entry; :func:`kl_estimate` applies the conventions."""


def check_estimator(estimator: str) -> None:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; expected one of {tuple(KL_ESTIMATORS)}"
        )


def check_aggregation(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")


def check_dual_clip(dual_clip: float | None) -> None:
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")


def kl_estimate(log_ratio, estimator: KlEstimator, xp):
    """Per-token KL(pi || ref) estimate from ``log_ratio = logprobs - ref_logprobs``, with
    the array module ``xp`` (``numpy``, ``jax.numpy`` or ``torch``: its ``clip``, ``exp``):
    the registered ``estimator`` (:data:`KL_ESTIMATORS`) of ``d``, the log-ratio clamped to
    ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]``, then bounded to ``[-KL_VALUE_LIMIT,
    KL_VALUE_LIMIT]``.
    """
    check_estimator(estimator)
    d = xp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return xp.clip(KL_ESTIMATORS[estimator](d, xp), -KL_VALUE_LIMIT, KL_VALUE_LIMIT)


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
    """A backend's array primitives, over which the losses (:func:`policy_terms`,
    :func:`value_terms`, the :data:`POLICY_LOSSES`, the micro-batch losses of
    :mod:`strop.objectives.micro`) are written once for both backends (differentiable,
    float32).

    ``xp``: ``jax.numpy`` or ``torch`` (its ``clip``, ``exp``, ``maximum``, ``minimum``,
    ``where``, ``zeros_like``, ``abs``); ``on(mask)``: the boolean response mask;
    ``select(on, x)``: ``x`` as float32 where ``on``, else 0; ``indicator(b)``: a boolean
    array as float32; ``stop_gradient(x)``: ``x`` without its gradient;
    ``token_logprobs(logits, input_ids, temperature)``: ``[B, L]`` ``log softmax(logits /
    T)`` of ``x_t`` from the logits at ``t - 1`` (column 0 is 0);
    ``token_entropy(logits, temperature)``: ``[B, L]`` the entropy of that distribution;
    ``segment_mean(x, segments, on)``: ``[B, L]``, on each ``on`` token the mean of ``x``
    over the ``on`` tokens of its row with the same segment id (one rollout, packed rows or
    not), 0 elsewhere.
    """

    xp: Any
    on: Callable[[Any], Any]
    select: Callable[[Any, Any], Any]
    indicator: Callable[[Any], Any]
    stop_gradient: Callable[[Any], Any]
    token_logprobs: Callable[[Any, Any, float], Any]
    token_entropy: Callable[[Any, float], Any]
    segment_mean: Callable[[Any, Any, Any], Any]


def weighted_sum(ops: ArrayOps, per_token, weights):
    """``sum(per_token * weights)`` over the columns with a weight, the others selected
    away (``0 * NaN`` would be NaN): a micro-batch's share of a mini-batch loss."""
    weighted = per_token * weights
    return ops.xp.where(weights > 0, weighted, ops.xp.zeros_like(weighted)).sum()


READABLE: dict[str, str] = {
    "ref_logprobs": "the reference's log-probabilities (needs ppo.kl_coef > 0 or ppo.log_kl)",
    "old_values": "the critic's values before the update (needs ppo.advantage_estimator=gae)",
    "returns": "the critic's return targets (needs ppo.advantage_estimator=gae)",
}
"""The update arrays a policy loss may declare it reads, beyond the ones every loss gets."""


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and its declared needs.

    ``fn(ops, inputs, objective) -> (per_token [B, L], terms)``: ``inputs`` holds
    ``logprobs`` (differentiable), ``old_logprobs``, ``advantages`` (all float32, 0 off
    the response), ``on`` (the boolean response mask), each array of ``reads`` (selected
    the same way) and, for a ``sequence_level`` loss, ``segments`` (``[B, L]`` ints: the
    tokens of one rollout share a value within a row, whether rows are packed or not).
    ``objective``: the
    :class:`~strop.objectives.ppo.PolicyObjective` (``clip_low``, ``clip_high``,
    ``dual_clip``, ...). ``per_token`` is 0 off the response; ``terms`` are per-token
    statistics, summed under the loss weights like the loss and logged as ``policy/NAME``.
    ``aggregation``: the ``ppo.loss_aggregation`` the loss was defined with, the run's when
    the config sets none (GSPO and SAPO average per sequence). ``ignores``: the ``ppo``
    settings it does not read (``dual_clip`` for CISPO and SAPO), which a run that sets
    them is told once.
    """

    fn: Callable[..., tuple[Any, dict[str, Any]]]
    reads: tuple[str, ...] = ()
    sequence_level: bool = False
    aggregation: str = "token_mean"
    ignores: tuple[str, ...] = ()


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""The policy losses' registry (``ppo.policy_loss``): a name -> :class:`PolicyLoss`."""


def check_reads(reads) -> None:
    unknown = [r for r in reads if r not in READABLE]
    if unknown:
        raise ValueError(
            f"unknown need {unknown[0]!r}: a policy loss may read {', '.join(READABLE)}"
        )


def check_declaration(entry: PolicyLoss) -> None:
    """A :class:`PolicyLoss`'s declared needs and aggregation are ones strop knows."""
    check_reads(entry.reads)
    if entry.aggregation not in (*AGGREGATIONS, CONSTANT_NORMALISED):
        raise ValueError(
            f"unknown aggregation {entry.aggregation!r}: a policy loss is defined with one of "
            f"{', '.join((*AGGREGATIONS, CONSTANT_NORMALISED))}"
        )


def policy_loss(
    name: str | None = None,
    *,
    reads=(),
    sequence_level: bool = False,
    aggregation: str = "token_mean",
    ignores=(),
):
    """Decorator declaring a policy loss's needs (the function's ``strop_loss``, a
    :class:`PolicyLoss`); with ``name``, also registered in :data:`POLICY_LOSSES`."""

    def declare(fn):
        entry = PolicyLoss(fn, tuple(reads), bool(sequence_level), aggregation, tuple(ignores))
        fn.strop_loss = entry
        if name is not None:
            check_declaration(entry)
            POLICY_LOSSES[name] = entry
        return fn

    return declare


def clipped_surrogate(ops: ArrayOps, ratio, advantages, clip_low, clip_high, dual_clip):
    """PPO's ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` per token, with
    ``dual_clip`` c (or None) bounding it by ``-A c`` where ``A < 0``; the ``clipfrac``
    indicator and, with a dual clip, the ``dual_clip_frac`` one."""
    check_dual_clip(dual_clip)
    xp = ops.xp
    pg1 = -advantages * ratio
    pg2 = -advantages * xp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = xp.maximum(pg1, pg2)
    terms = {"clipfrac": ops.indicator(pg2 > pg1)}
    if dual_clip is None:
        return clipped, terms
    bound = -advantages * dual_clip
    terms["dual_clip_frac"] = ops.indicator((advantages < 0) & (clipped > bound))
    return xp.where(advantages < 0, xp.minimum(clipped, bound), clipped), terms


def reweighted(ops: ArrayOps, per_token, on, is_weights):
    """``per_token`` times a rollout correction's weights (finite, no gradient); the tokens
    they drop (weight 0) are selected away, not multiplied by 0."""
    weights = ops.select(on, is_weights)
    return ops.xp.where(weights > 0, per_token * weights, ops.xp.zeros_like(per_token))


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
    (:mod:`strop.rl.rollout_correction`), multiplied into the loss term
    (:func:`reweighted`)."""
    xp = ops.xp
    on = ops.on(mask)
    log_ratio = ops.select(on, logprobs) - ops.select(on, old_logprobs)
    ratio = xp.exp(xp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    adv = ops.select(on, advantages)
    loss, clip_terms = clipped_surrogate(ops, ratio, adv, clip_low, clip_high, dual_clip)
    terms = {"clipfrac": clip_terms.pop("clipfrac"), "approx_kl": 0.5 * log_ratio * log_ratio}
    terms.update(clip_terms)
    if is_weights is not None:
        loss = reweighted(ops, loss, on, is_weights)
    return loss, terms


@policy_loss("ppo")
def ppo(ops: ArrayOps, inputs, objective):
    """PPO's clipped surrogate (:func:`policy_terms`), with ``ppo.dual_clip``."""
    return policy_terms(
        ops, inputs["logprobs"], inputs["old_logprobs"], inputs["advantages"], inputs["on"],
        objective.clip_low, objective.clip_high, objective.dual_clip,
    )  # fmt: skip


@policy_loss("gspo", sequence_level=True, aggregation="sequence_mean")
def gspo(ops: ArrayOps, inputs, objective):
    """GSPO (Zheng et al. 2025; verl's ``compute_policy_loss_gspo``, TRL's
    ``importance_sampling_level="sequence"``): PPO's clipped surrogate of the sequence
    ratio ``s_i = exp(mean_t (logp - old_logp))`` over rollout ``i``'s response tokens, as
    ``s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])`` on each token (the value ``s_i``, the
    gradient of token ``t``'s own log-probability), log-clamped like the token ratio."""
    xp, on, logp = ops.xp, inputs["on"], inputs["logprobs"]
    log_ratio = logp - inputs["old_logprobs"]
    sequence = ops.segment_mean(ops.stop_gradient(log_ratio), inputs["segments"], on)
    log_ratio_t = xp.clip(
        sequence + logp - ops.stop_gradient(logp), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT
    )
    loss, terms = clipped_surrogate(
        ops, xp.exp(log_ratio_t), inputs["advantages"], objective.clip_low,
        objective.clip_high, objective.dual_clip,
    )  # fmt: skip
    return loss, {"approx_kl": 0.5 * log_ratio * log_ratio, **terms}


@policy_loss("cispo", ignores=("dual_clip",))
def cispo(ops: ArrayOps, inputs, objective):
    """CISPO (MiniMax-M1; verl's ``compute_policy_loss_cispo``): ``-sg[clip(r, 1 - clip_low,
    1 + clip_high)] * A * logp`` per token: the clipped ratio is a weight without gradient,
    so a clipped token keeps its gradient. ``clipfrac``: the ratio outside the band."""
    xp, logp = ops.xp, inputs["logprobs"]
    log_ratio = logp - inputs["old_logprobs"]
    ratio = xp.exp(xp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    low, high = 1.0 - objective.clip_low, 1.0 + objective.clip_high
    weight = ops.stop_gradient(xp.clip(ratio, low, high))
    terms = {"clipfrac": ops.indicator((ratio < low) | (ratio > high))}
    return -weight * inputs["advantages"] * logp, {**terms, "approx_kl": 0.5 * log_ratio**2}


@policy_loss("sapo", aggregation="sequence_mean", ignores=("clip_low", "clip_high", "dual_clip"))
def sapo(ops: ArrayOps, inputs, objective):
    """SAPO (Gao et al. 2025; TRL's ``loss_type="sapo"``): a soft gate instead of the clip,
    ``-A * sigmoid(tau * (r - 1)) * 4 / tau`` per token, ``tau`` =
    ``ppo.sapo_temperature_pos`` where ``A > 0``, else ``ppo.sapo_temperature_neg`` (its
    gradient at ``r = 1`` is PPO's, and fades as ``r`` leaves 1)."""
    xp, adv = ops.xp, inputs["advantages"]
    log_ratio = inputs["logprobs"] - inputs["old_logprobs"]
    ratio = xp.exp(xp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    pos, neg = objective.sapo_temperature_pos, objective.sapo_temperature_neg
    tau = neg + (pos - neg) * ops.indicator(adv > 0)
    gate = 4.0 / (tau * (1.0 + xp.exp(-tau * (ratio - 1.0))))
    return -adv * gate, {"approx_kl": 0.5 * log_ratio * log_ratio}


MAX_STATS = frozenset({"mismatch_abs_diff_max"})
"""Update stats reduced by ``max`` over micro-batches and ranks (every other one is a sum)."""

ROUTER_AUX_LOSS = "moe/aux_loss"
"""The update stat of a model with routed experts: the router's load-balancing loss (a
mean over the micro-batches), which the update adds times ``router_aux_loss_coef``."""


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
