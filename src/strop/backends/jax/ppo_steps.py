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
:mod:`strop.rl.objectives`), so the micro-batch sums add up to the mini-batch loss. Columns
without a loss weight are selected away (``where``) before any non-linear op, never
multiplied by 0, so whatever they hold (NaN, Inf) reaches neither a loss nor a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from strop.backends.jax.losses import (
    entropy_from_logits,
    kl_penalty,
    policy_terms,
    value_terms,
)
from strop.backends.jax.train import is_finite_step
from strop.rl.objectives import PolicyObjective, ValueObjective

F32 = jnp.float32
Role = tuple[nnx.GraphDef, nnx.State, nnx.State]


def _shift(per_column: jax.Array) -> jax.Array:
    """``[B, L-1]`` values about ``x_1..x_{L-1}`` -> ``[B, L]`` with column 0 = 0."""
    return jnp.pad(per_column, ((0, 0), (1, 0)))


def token_logprobs(logits: jax.Array, input_ids: jax.Array, temperature: float) -> jax.Array:
    """``[B, L]``: ``log softmax(logits / T)`` of ``x_t`` from the logits at ``t - 1``."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(F32) / temperature, axis=-1)
    chosen = jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    return _shift(chosen)


def _lm_logits(graphdef, trainable, frozen, input_ids, attention_mask) -> jax.Array:
    return nnx.merge(graphdef, trainable, frozen)(input_ids, attention_mask).logits


def _critic_values(graphdef, trainable, frozen, input_ids, attention_mask) -> jax.Array:
    return nnx.merge(graphdef, trainable, frozen).values(input_ids, attention_mask)


@partial(jax.jit, static_argnums=(0, 5))
def logprobs(graphdef, trainable, frozen, input_ids, attention_mask, temperature: float):
    """``[B, L]`` log-probabilities of the batch's tokens under a policy role."""
    logits = _lm_logits(graphdef, trainable, frozen, input_ids, attention_mask)
    return token_logprobs(logits, input_ids, temperature)


@partial(jax.jit, static_argnums=(0,))
def values(graphdef, trainable, frozen, input_ids, attention_mask):
    """``[B, L]`` critic values ``V(x_<t)`` (the value head at column ``t - 1``)."""
    return _critic_values(graphdef, trainable, frozen, input_ids, attention_mask)


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
    )  # fmt: skip
    entropy = _shift(entropy_from_logits(logits[:, :-1] / objective.temperature))
    pg_loss = _weighted_sum(per_token, weights)
    entropy_sum = _weighted_sum(entropy, weights)
    loss = pg_loss - objective.entropy_coef * entropy_sum
    stats = {name: _weighted_sum(term, weights) for name, term in terms.items()}
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


def _accumulate(micro_loss: Callable, trainable, batch: dict[str, jax.Array]):
    """Sum of ``micro_loss``'s (loss, stats) and gradients over the leading micro axis."""
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def body(carry, micro):
        (loss, stats), grads = grad_fn(trainable, micro)
        return jax.tree.map(jnp.add, carry, (grads, loss, stats)), None

    first = jax.tree.map(lambda x: x[0], batch)
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, trainable, first))
    (loss_zero, stats_zero), grads_zero = zeros
    (grads, loss, stats), _ = jax.lax.scan(body, (grads_zero, loss_zero, stats_zero), batch)
    return grads, loss, stats


def _apply(tx: optax.GradientTransformation, trainable, opt_state, grads, loss):
    """The optimizer step, applied only if ``loss`` and the gradient norm are finite
    (:func:`~strop.backends.jax.train.is_finite_step`); otherwise ``trainable`` and
    ``opt_state`` come back unchanged. Returns them, the norm and ``skipped`` (0 or 1)."""
    norm = optax.tree.norm(grads)
    applied = is_finite_step(loss, norm)

    def update(trainable, opt_state):
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    trainable, opt_state = jax.lax.cond(applied, update, lambda *state: state, trainable, opt_state)
    return trainable, opt_state, norm, jnp.logical_not(applied).astype(F32)


def policy_update(
    graphdef: nnx.GraphDef,
    objective: PolicyObjective,
    tx: optax.GradientTransformation,
    trainable,
    opt_state,
    frozen,
    batch: dict[str, jax.Array],
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One actor update over a mini-batch; returns the new trainable part, optimizer state
    and the summed statistics (``loss``, ``clipfrac``, ``approx_kl``, ``entropy``, ...,
    ``skipped``: 1 when a non-finite loss or gradient norm left everything unchanged)."""

    def micro_loss(trainable, micro):
        logits = _lm_logits(
            graphdef, trainable, frozen, micro["input_ids"], micro["attention_mask"]
        )
        return policy_micro_loss(logits, micro, objective)

    grads, loss, stats = _accumulate(micro_loss, trainable, batch)
    trainable, opt_state, norm, skipped = _apply(tx, trainable, opt_state, grads, loss)
    return trainable, opt_state, {"loss": loss, "grad_norm": norm, "skipped": skipped, **stats}


def critic_update(
    graphdef: nnx.GraphDef,
    objective: ValueObjective,
    tx: optax.GradientTransformation,
    trainable,
    opt_state,
    frozen,
    batch: dict[str, jax.Array],
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One critic update over a mini-batch; stats ``loss`` (the unscaled value loss),
    ``vf_clipfrac``, ``value_mean``, ``grad_norm`` and ``skipped`` (as in the policy's)."""

    def micro_loss(trainable, micro):
        new = _critic_values(
            graphdef, trainable, frozen, micro["input_ids"], micro["attention_mask"]
        )
        return critic_micro_loss(new, micro, objective)

    grads, scaled_loss, stats = _accumulate(micro_loss, trainable, batch)
    trainable, opt_state, norm, skipped = _apply(tx, trainable, opt_state, grads, scaled_loss)
    return trainable, opt_state, {"grad_norm": norm, "skipped": skipped, **stats}
