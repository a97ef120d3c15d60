"""The actor's and the critic's loss over one micro-batch, written once over a backend's
:class:`~strop.objectives.losses.ArrayOps`: each backend calls these with its ``OPS``
(``strop.backends.<name>.losses``) and its forward's logits or values.

Micro-batch arrays are ``[rows, L]`` (column ``t`` is about ``x_t``, read from the logits at
column ``t - 1``; see :mod:`strop.objectives.gae`). Losses are ``sum(per_token * loss_weights)``
(:mod:`strop.objectives.ppo`), so micro-batch and rank sums add up to the mini-batch loss,
and a packed micro-batch (segment ids in ``attention_mask``, see :mod:`strop.batch.packing`)
gives the loss of its rows unpacked. Only columns with a loss weight (the response tokens)
count: the data there is selected before any non-linear op, so NaN/Inf in the other
columns of ``old_logprobs``, ``advantages``, ``ref_logprobs``, ``old_values`` or
``returns`` change neither a loss nor its gradient. Statistics carry no gradient.
"""

from __future__ import annotations

from typing import Any

from strop.batch.packing import PREFIX_STRIDE as SEGMENT_STRIDE
from strop.objectives.losses import (
    ArrayOps,
    kl_estimate,
    mismatch_stats,
    reweighted,
    value_terms,
    weighted_sum,
)
from strop.objectives.plugins import resolve_policy_loss
from strop.objectives.ppo import WEIGHTS, PolicyObjective, ValueObjective

# A packed ``attention_mask`` is ``segment + SEGMENT_STRIDE * prefix``
# (strop.batch.packing): its remainder is the token's segment, one rollout's within its
# row (an unpacked row's tokens are all segment 1).

Stats = dict[str, Any]


def policy_micro_loss(
    ops: ArrayOps, logits, micro: dict[str, Any], objective: PolicyObjective
) -> tuple[Any, Stats]:
    """The actor's weighted loss over one micro-batch (``ppo.policy_loss``'s per-token
    loss, a rollout correction's weights, the entropy bonus, a KL term) and its weighted
    statistics: the loss's terms, ``pg_loss``, ``entropy``, ``kl_loss`` (with a KL term in
    the loss) and the mismatch sums (:func:`~strop.objectives.losses.mismatch_stats`)."""
    weights = micro["loss_weights"]
    on = weights > 0
    logp = ops.select(on, ops.token_logprobs(logits, micro["input_ids"], objective.temperature))
    entry = resolve_policy_loss(objective.policy_loss)
    inputs = {
        "logprobs": logp,
        "old_logprobs": ops.select(on, micro["old_logprobs"]),
        "advantages": ops.select(on, micro["advantages"]),
        "on": on,
        **{name: ops.select(on, micro[name]) for name in entry.reads},
    }
    if entry.sequence_level:
        inputs["segments"] = (micro["attention_mask"] * 1) % SEGMENT_STRIDE  # ints, not bools
    per_token, terms = entry.fn(ops, inputs, objective)
    if WEIGHTS in micro:  # a rollout correction's (ppo.rollout_correction)
        per_token = reweighted(ops, per_token, on, micro[WEIGHTS])
    entropy = ops.token_entropy(logits, objective.temperature)
    pg_loss = weighted_sum(ops, per_token, weights)
    entropy_sum = weighted_sum(ops, entropy, weights)
    loss = pg_loss - objective.entropy_coef * entropy_sum
    stats = {name: weighted_sum(ops, term, weights) for name, term in terms.items()}
    stats.update(mismatch_stats(ops, ops.stop_gradient(logp), micro["old_logprobs"], on))
    stats["pg_loss"] = pg_loss
    stats["entropy"] = entropy_sum
    if objective.kl_in_loss:
        log_ratio = logp - ops.select(on, micro["ref_logprobs"])
        kl = kl_estimate(log_ratio, objective.kl_estimator, ops.xp)
        stats["kl_loss"] = weighted_sum(ops, kl, weights)
        loss = loss + objective.kl_coef * stats["kl_loss"]
    return loss, {name: ops.stop_gradient(value) for name, value in stats.items()}


def critic_micro_loss(
    ops: ArrayOps, values, micro: dict[str, Any], objective: ValueObjective
) -> tuple[Any, Stats]:
    """The critic's weighted (scaled) loss over one micro-batch; stat ``loss`` is the
    unscaled one, plus ``vf_clipfrac`` and ``value_mean``."""
    weights = micro["loss_weights"]
    on = weights > 0
    per_token, clipped = value_terms(
        ops, values, micro["old_values"], micro["returns"], on, objective.value_clip
    )
    loss = weighted_sum(ops, per_token, weights)
    stats = {
        "vf_clipfrac": weighted_sum(ops, clipped, weights),
        "value_mean": weighted_sum(ops, values, weights),
        "loss": loss,
    }
    return objective.coef * loss, {name: ops.stop_gradient(v) for name, v in stats.items()}
