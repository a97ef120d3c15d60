"""On-policy distillation's generalized JSD in JAX, chunk by chunk of tokens.

:func:`chunked_jsd_sum` takes the final normed hidden states of the student and the teacher
on the same ids (the models' ``CausalLMOutput.hidden``; their unused ``logits`` are dead code
under ``jit``) and each model's head (:meth:`CausalLM.logits_from_hidden
<strop.backends.jax.model.CausalLM.logits_from_hidden>`), and scans over chunks of
``chunk_tokens`` tokens: one chunk's full-vocabulary logits of both models are computed, fed
to the core's :func:`~strop.objectives.distill.generalized_jsd` and summed under the loss
weights. Each chunk is rematerialised (``jax.checkpoint``), so the backward pass keeps only
the hidden states and recomputes one chunk's logits at a time: the ``[B, L, V]`` logits of
neither model are ever whole in memory. The torch backend's ``distill.py`` is the same.

:func:`jsd_loss` is ``distill.loss=jsd``'s student update over one micro-batch
(``JaxActorCritic.train_jsd``, jitted by :func:`jit_jsd_update`): the frozen teacher's
forward, the student's, and the chunked JSD over both heads.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from strop.backends.jax.losses import F32, OPS
from strop.backends.jax.train import jit_update, with_router_loss
from strop.objectives.distill import (
    DEFAULT_CHUNK_TOKENS,
    JsdObjective,
    check_beta,
    check_chunk_tokens,
    check_temperature,
    generalized_jsd,
)
from strop.objectives.losses import weighted_sum

Head = Callable[[jax.Array], jax.Array]
"""A model's head: final normed hidden states ``[n, E]`` -> logits ``[n, V]``."""


def log_probs(head: Head, hidden: jax.Array, on: jax.Array, temperature: float) -> jax.Array:
    """``log_softmax(head(hidden) / temperature)`` ``[n, V]`` in float32, the rows of
    ``hidden`` off ``on`` selected to 0 first (whatever they hold reaches neither the result
    nor a gradient, the head's included)."""
    logits = head(jnp.where(on[:, None], hidden, jnp.zeros((), hidden.dtype))).astype(F32)
    return jax.nn.log_softmax(logits / temperature, axis=-1)


def chunked_jsd_sum(
    student_hidden: jax.Array,
    teacher_hidden: jax.Array,
    student_head: Head,
    teacher_head: Head,
    weights: jax.Array,
    *,
    beta: float,
    temperature: float,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> jax.Array:
    """``sum_{b,t} weights[b, t] * JSD_beta(student || teacher)`` of the next-token
    distributions at column ``t - 1`` (a float32 scalar; differentiable wrt the student).

    ``student_hidden [B, L, E_s]`` and ``teacher_hidden [B, L, E_t]`` are the two models'
    final hidden states on the same ``[B, L]`` ids; ``weights [B, L]`` the loss weights in the
    teacher-forcing layout (column ``t`` weighs the prediction of ``x_t``), 0 off the
    response: ``mask / mask.sum()`` gives TRL's ``batchmean`` (a sum over the vocabulary and
    the tokens, divided by the tokens). The teacher gets no gradient. ``beta``,
    ``temperature`` and ``chunk_tokens`` are static (Python numbers); the last chunk is
    padded with weight-0 tokens."""
    check_beta(beta)
    check_temperature(temperature)
    check_chunk_tokens(chunk_tokens)
    student = student_hidden[:, :-1].reshape(-1, student_hidden.shape[-1])
    teacher = jax.lax.stop_gradient(teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1]))
    token_weights = jnp.asarray(weights, F32)[:, 1:].reshape(-1)
    tokens = token_weights.shape[0]
    chunk = max(1, min(chunk_tokens, tokens))  # one chunk when there are fewer tokens
    chunks = -(-tokens // chunk)

    def split(x: jax.Array) -> jax.Array:
        padding = ((0, chunks * chunk - tokens),) + ((0, 0),) * (x.ndim - 1)
        return jnp.pad(x, padding).reshape(chunks, chunk, *x.shape[1:])

    @jax.checkpoint
    def chunk_sum(student_chunk, teacher_chunk, weight_chunk):
        on = weight_chunk > 0
        student_logp = log_probs(student_head, student_chunk, on, temperature)
        teacher_logp = log_probs(teacher_head, teacher_chunk, on, temperature)
        jsd = generalized_jsd(OPS, student_logp, teacher_logp, beta)
        return weighted_sum(OPS, jsd, weight_chunk)

    def step(total, chunk_inputs):
        return total + chunk_sum(*chunk_inputs), None

    parts = (split(student), split(teacher), split(token_weights))
    total, _ = jax.lax.scan(step, jnp.zeros((), F32), parts)
    return total


def jsd_loss(
    graphs: tuple[nnx.GraphDef, nnx.GraphDef], objective: JsdObjective, trainable: Any,
    frozen: tuple[Any, tuple[Any, Any]], micro: dict[str, jax.Array],
) -> tuple[jax.Array, dict[str, jax.Array]]:  # fmt: skip
    """A micro-batch's share of the student's JSD loss (:class:`JsdObjective`: the sum under
    its ``loss_weights``; plus a routed-experts student's load-balancing loss, as PPO's
    policy loss has it), for :func:`~strop.backends.jax.train.update`; stat ``jsd``.

    ``graphs`` are the student's and the teacher's graphdefs; ``frozen`` is the student's
    frozen part and the teacher's ``(trainable, frozen)`` parts of the role it scores with:
    arguments, never differentiated, so the teacher's forward and head are constants. Both
    models' ``logits`` are unused, so under ``jit`` they are never computed."""
    student_graph, teacher_graph = graphs
    student_frozen, (teacher_trainable, teacher_frozen) = frozen
    inputs = micro["input_ids"], micro["attention_mask"], micro.get("positions")
    teacher = nnx.merge(teacher_graph, teacher_trainable, teacher_frozen)
    teacher_hidden = jax.lax.stop_gradient(teacher(*inputs).hidden)
    student = nnx.merge(student_graph, trainable, student_frozen)
    output = student(*inputs)
    jsd = chunked_jsd_sum(
        output.hidden, teacher_hidden, student.logits_from_hidden, teacher.logits_from_hidden,
        micro["loss_weights"], beta=objective.beta, temperature=objective.temperature,
        chunk_tokens=objective.chunk_tokens,
    )  # fmt: skip
    return with_router_loss(student, output, jsd, {"jsd": jax.lax.stop_gradient(jsd)}, micro)


def jit_jsd_update(
    tx: optax.GradientTransformation,
    student_graph: nnx.GraphDef,
    teacher_graph: nnx.GraphDef,
    objective: JsdObjective,
) -> Callable:
    """The student's jitted JSD update (:func:`~strop.backends.jax.train.jit_update` of
    :func:`jsd_loss`): ``(trainable, opt_state, (frozen, (teacher_trainable,
    teacher_frozen)), batch)`` -> the new trainable and optimizer states and the stats."""
    loss = partial(jsd_loss, (student_graph, teacher_graph), objective)
    return jit_update(tx, loss, name="jsd_update")
