"""The JAX backend's PPO computations: log-probabilities, values and the two updates, jitted.

Every model here is a *role* held functionally as ``(graphdef, trainable, frozen)`` — the
three parts ``nnx.split(module, trainable_filter, ...)`` returns. The actor, the critic and
the reference differ in their ``trainable`` part (with LoRA: three adapters, plus the
critic's value head) and share one ``frozen`` part: the same base-weight arrays, held once
in device memory. Updates take ``trainable`` and the optimizer state as donated
arguments and ``frozen`` as a plain one, so an update never invalidates the shared base.

Per-token arrays follow :mod:`strop.objectives.gae`: column ``t`` is about token ``x_t``, read
from the logits (or hidden state) at column ``t - 1``; column 0 is 0. Micro-batch arrays
come stacked ``[micro, rows, L]``; losses are ``sum(per_token * loss_weights)`` (see
:mod:`strop.objectives.ppo`), so the micro-batch sums add up to the mini-batch loss, and a
packed batch (:mod:`strop.batch.packing`: segment ids in ``attention_mask``, plus
``positions``) gives the loss of its rows unpacked. The two
updates are :func:`strop.backends.jax.train.update` (the one accumulate-and-apply, with
the one non-finite guard, that SFT uses too) of :func:`policy_loss` and
:func:`critic_loss`: this backend's forwards, then the micro-batch losses written once in
:mod:`strop.objectives.micro`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from strop.backends.jax.losses import OPS, token_logprobs
from strop.backends.jax.train import with_router_loss
from strop.objectives.gae import shift_values
from strop.objectives.micro import critic_micro_loss, policy_micro_loss
from strop.objectives.ppo import SHARED_CRITIC_PREFIX, PolicyObjective, ValueObjective


def _lm_forward(graphdef, trainable, frozen, input_ids, attention_mask, positions):
    """A policy role as a model, and its forward's :class:`CausalLMOutput`."""
    model = nnx.merge(graphdef, trainable, frozen)
    return model, model(input_ids, attention_mask, positions)


def _critic_values(graphdef, trainable, frozen, input_ids, attention_mask, positions):
    return nnx.merge(graphdef, trainable, frozen).values(input_ids, attention_mask, positions)


@partial(jax.jit, static_argnums=(0, 6))
def logprobs(graphdef, trainable, frozen, input_ids, attention_mask, positions, temperature):
    """``[B, L]`` log-probabilities of the batch's tokens under a policy role
    (``positions``: ``None``, or a packed batch's, see :mod:`strop.batch.packing`)."""
    _, output = _lm_forward(graphdef, trainable, frozen, input_ids, attention_mask, positions)
    return token_logprobs(output.logits, input_ids, temperature)


@partial(jax.jit, static_argnums=(0,))
def values(graphdef, trainable, frozen, input_ids, attention_mask, positions):
    """``[B, L]`` critic values ``V(x_<t)`` (the value head at column ``t - 1``)."""
    return _critic_values(graphdef, trainable, frozen, input_ids, attention_mask, positions)


def policy_loss(
    graphdef: nnx.GraphDef, objective: PolicyObjective, trainable, frozen, micro
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The actor's micro-batch loss (:func:`policy_micro_loss`, plus
    :func:`~strop.backends.jax.train.with_router_loss`) for
    :func:`~strop.backends.jax.train.update`, whose stats are then ``loss``, ``clipfrac``,
    ``approx_kl``, ``entropy``, ..., ``grad_norm`` and ``skipped``."""
    model, output = _lm_forward(
        graphdef, trainable, frozen, micro["input_ids"], micro["attention_mask"],
        micro.get("positions"),
    )  # fmt: skip
    loss, stats = policy_micro_loss(OPS, output.logits, micro, objective)
    return with_router_loss(model, output, loss, stats, micro)


def _shared_forward(graphs, trainable, frozen, input_ids, attention_mask, positions):
    """``critic.shared_trunk``: the actor (as a model), its forward and the value head's
    values from that one forward (``graphs`` = the actor's and the head's graphdefs,
    ``trainable`` = ``{"actor": ..., "head": ...}``)."""
    actor_graph, head_graph = graphs
    model, out = _lm_forward(actor_graph, trainable["actor"], frozen, input_ids, attention_mask,
                             positions)  # fmt: skip
    raw = nnx.merge(head_graph, trainable["head"])(out.hidden)[..., 0]
    return model, out, shift_values(raw, xp=jnp)


@partial(jax.jit, static_argnums=(0,))
def shared_values(graphs, trainable, frozen, input_ids, attention_mask, positions):
    """``[B, L]`` values ``V(x_<t)`` of the value head on the actor's trunk."""
    return _shared_forward(graphs, trainable, frozen, input_ids, attention_mask, positions)[2]


def shared_loss(
    graphs, objectives: tuple[PolicyObjective, ValueObjective], trainable, frozen, micro
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``critic.shared_trunk``'s micro-batch loss for :func:`~strop.backends.jax.train.update`:
    the policy's plus the (scaled) value loss, from one forward; stat ``loss`` is the
    policy's part and the critic's stats carry ``SHARED_CRITIC_PREFIX``."""
    policy, value = objectives
    model, output, values = _shared_forward(
        graphs, trainable, frozen, micro["input_ids"], micro["attention_mask"],
        micro.get("positions"),
    )  # fmt: skip
    loss, stats = with_router_loss(
        model, output, *policy_micro_loss(OPS, output.logits, micro, policy), micro
    )
    value_loss, value_stats = critic_micro_loss(OPS, values, micro, value)
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
    return critic_micro_loss(OPS, values, micro, objective)
