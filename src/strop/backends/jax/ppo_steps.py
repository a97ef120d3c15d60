"""The JAX backend's PPO computations: log-probabilities, values and the two updates, jitted.

Every model here is a *role* held functionally as ``(graphdef, trainable, frozen)`` — the
three parts ``nnx.split(module, trainable_filter, ...)`` returns. The actor, the critic and
the reference differ in their ``trainable`` part (with LoRA: three adapters, plus the
critic's value head) and share one ``frozen`` part: the same base-weight arrays, held once
in device memory. Updates take ``trainable`` and the optimizer state as donated
arguments and ``frozen`` as a plain one, so an update never invalidates the shared base.

Per-token arrays follow :mod:`strop.rl.gae`: column ``t`` is about token ``x_t``, read
from the logits (or hidden state) at column ``t - 1``; column 0 is 0. Micro-batch arrays
come stacked ``[micro, rows, L]``; losses are ``sum(per_token * loss_weights)`` (see
:mod:`strop.rl.objectives`), so the micro-batch sums add up to the mini-batch loss, and a
packed batch (:mod:`strop.batch.packing`: segment ids in ``attention_mask``, plus
``positions``) gives the loss of its rows unpacked. The two
updates are :func:`strop.backends.jax.train.update` (the one accumulate-and-apply, with
the one non-finite guard, that SFT uses too) of :func:`policy_loss` and
:func:`critic_loss`. Columns
without a loss weight are selected away (``where``) before any non-linear op, never
multiplied by 0, so whatever they hold (NaN, Inf) reaches neither a loss nor a gradient.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from strop.backends.jax.losses import (
    entropy_from_logits,
    kl_penalty,
    mismatch_stats,
    policy_terms,
    shift_values,
    value_terms,
)
from strop.rl.objectives import SHARED_CRITIC_PREFIX, PolicyObjective, ValueObjective
from strop.rl.rollout_correction import WEIGHTS

F32 = jnp.float32


def _shift(per_column: jax.Array) -> jax.Array:
    """``[B, L-1]`` values about ``x_1..x_{L-1}`` -> ``[B, L]`` with column 0 = 0."""
    return jnp.pad(per_column, ((0, 0), (1, 0)))


def token_logprobs(logits: jax.Array, input_ids: jax.Array, temperature: float) -> jax.Array:
    """``[B, L]``: ``log softmax(logits / T)`` of ``x_t`` from the logits at ``t - 1``."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(F32) / temperature, axis=-1)
    chosen = jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    return _shift(chosen)


def _lm_logits(graphdef, trainable, frozen, input_ids, attention_mask, positions) -> jax.Array:
    return nnx.merge(graphdef, trainable, frozen)(input_ids, attention_mask, positions).logits


def _critic_values(graphdef, trainable, frozen, input_ids, attention_mask, positions):
    return nnx.merge(graphdef, trainable, frozen).values(input_ids, attention_mask, positions)


@partial(jax.jit, static_argnums=(0, 6))
def logprobs(graphdef, trainable, frozen, input_ids, attention_mask, positions, temperature):
    """``[B, L]`` log-probabilities of the batch's tokens under a policy role
    (``positions``: ``None``, or a packed batch's, see :mod:`strop.batch.packing`)."""
    logits = _lm_logits(graphdef, trainable, frozen, input_ids, attention_mask, positions)
    return token_logprobs(logits, input_ids, temperature)


@partial(jax.jit, static_argnums=(0,))
def values(graphdef, trainable, frozen, input_ids, attention_mask, positions):
    """``[B, L]`` critic values ``V(x_<t)`` (the value head at column ``t - 1``)."""
    return _critic_values(graphdef, trainable, frozen, input_ids, attention_mask, positions)


def _weighted_sum(per_token: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(per_token * weights)`` over the columns with a weight, the others selected
    away (``0 * NaN`` would be NaN)."""
    return jnp.where(weights > 0, per_token * weights, 0.0).sum()


def _select(on: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.where(on, x.astype(F32), 0.0)


def policy_micro_loss(
    logits: jax.Array, micro: dict[str, jax.Array], objective: PolicyObjective
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The actor's weighted loss over one micro-batch and its weighted statistics.

    Only columns with a loss weight (the response tokens) count: the data there is
    selected before any non-linear op, so NaN/Inf in the other columns of
    ``old_logprobs``, ``advantages`` or ``ref_logprobs`` change neither the loss nor its
    gradient."""
    ids, weights = micro["input_ids"], micro["loss_weights"]
    on = weights > 0
    logp = _select(on, token_logprobs(logits, ids, objective.temperature))
    per_token, terms = policy_terms(
        logp, micro["old_logprobs"], micro["advantages"], on,
        objective.clip_low, objective.clip_high, objective.dual_clip,
        micro.get(WEIGHTS),  # a rollout correction's (ppo.rollout_correction), or None
    )  # fmt: skip
    entropy = _shift(entropy_from_logits(logits[:, :-1] / objective.temperature))
    pg_loss = _weighted_sum(per_token, weights)
    entropy_sum = _weighted_sum(entropy, weights)
    loss = pg_loss - objective.entropy_coef * entropy_sum
    stats = {name: _weighted_sum(term, weights) for name, term in terms.items()}
    stats.update(mismatch_stats(logp, micro["old_logprobs"], on))
    stats["pg_loss"] = pg_loss
    stats["entropy"] = entropy_sum
    if objective.kl_in_loss:
        ref = _select(on, micro["ref_logprobs"])
        kl = kl_penalty(logp, ref, objective.kl_estimator)
        stats["kl_loss"] = _weighted_sum(kl, weights)
        loss = loss + objective.kl_coef * stats["kl_loss"]
    return loss, jax.tree.map(jax.lax.stop_gradient, stats)


def critic_micro_loss(
    values: jax.Array, micro: dict[str, jax.Array], objective: ValueObjective
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The critic's weighted (scaled) loss over one micro-batch; stat ``loss`` is the
    unscaled one, plus ``vf_clipfrac`` and ``value_mean``. NaN/Inf in ``old_values`` or
    ``returns`` off the response change neither the loss nor its gradient."""
    weights = micro["loss_weights"]
    on = weights > 0
    per_token, clipped = value_terms(
        values, micro["old_values"], micro["returns"], on, objective.value_clip
    )
    loss = _weighted_sum(per_token, weights)
    stats = {
        "vf_clipfrac": _weighted_sum(clipped, weights),
        "value_mean": _weighted_sum(values, weights),
        "loss": loss,
    }
    return objective.coef * loss, jax.tree.map(jax.lax.stop_gradient, stats)


def policy_loss(
    graphdef: nnx.GraphDef, objective: PolicyObjective, trainable, frozen, micro
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The actor's micro-batch loss (:func:`policy_micro_loss`) for
    :func:`~strop.backends.jax.train.update`, whose stats are then ``loss``, ``clipfrac``,
    ``approx_kl``, ``entropy``, ..., ``grad_norm`` and ``skipped``."""
    logits = _lm_logits(
        graphdef, trainable, frozen, micro["input_ids"], micro["attention_mask"],
        micro.get("positions"),
    )  # fmt: skip
    return policy_micro_loss(logits, micro, objective)


def _shared_forward(graphs, trainable, frozen, input_ids, attention_mask, positions):
    """``critic.shared_trunk``: the actor's logits and the value head's values from one
    forward (``graphs`` = the actor's and the head's graphdefs, ``trainable`` =
    ``{"actor": ..., "head": ...}``)."""
    actor_graph, head_graph = graphs
    out = nnx.merge(actor_graph, trainable["actor"], frozen)(input_ids, attention_mask, positions)
    raw = nnx.merge(head_graph, trainable["head"])(out.hidden)[..., 0]
    return out.logits, shift_values(raw)


@partial(jax.jit, static_argnums=(0,))
def shared_values(graphs, trainable, frozen, input_ids, attention_mask, positions):
    """``[B, L]`` values ``V(x_<t)`` of the value head on the actor's trunk."""
    return _shared_forward(graphs, trainable, frozen, input_ids, attention_mask, positions)[1]


def shared_loss(
    graphs, objectives: tuple[PolicyObjective, ValueObjective], trainable, frozen, micro
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``critic.shared_trunk``'s micro-batch loss for :func:`~strop.backends.jax.train.update`:
    the policy's plus the (scaled) value loss, from one forward; stat ``loss`` is the
    policy's part and the critic's stats carry ``SHARED_CRITIC_PREFIX``."""
    policy, value = objectives
    logits, values = _shared_forward(
        graphs, trainable, frozen, micro["input_ids"], micro["attention_mask"],
        micro.get("positions"),
    )  # fmt: skip
    loss, stats = policy_micro_loss(logits, micro, policy)
    value_loss, value_stats = critic_micro_loss(values, micro, value)
    stats = {"loss": jax.lax.stop_gradient(loss), **stats}
    stats.update({SHARED_CRITIC_PREFIX + k: v for k, v in value_stats.items()})
    return loss + value_loss, stats


def critic_loss(
    graphdef: nnx.GraphDef, objective: ValueObjective, trainable, frozen, micro
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The critic's micro-batch loss (:func:`critic_micro_loss`) for
    :func:`~strop.backends.jax.train.update`; stat ``loss`` is the unscaled value loss."""
    values = _critic_values(
        graphdef, trainable, frozen, micro["input_ids"], micro["attention_mask"],
        micro.get("positions"),
    )  # fmt: skip
    return critic_micro_loss(values, micro, objective)
