"""PPO losses in ``jax.numpy``: differentiable, float32, jit-friendly.

This backend's array primitives (:data:`OPS`: ``select``, ``token_logprobs``,
``token_entropy``, ``segment_mean``, ...), over which :mod:`strop.objectives`' losses are
written once for both backends: :mod:`strop.backends.jax.ppo_steps` calls the micro-batch
losses (:mod:`strop.objectives.micro`) with ``OPS`` and its forwards' logits and values.
They follow the conventions of :mod:`strop.objectives.losses`
(see ``docs/ppo.md`` for the formulas) and are tested against the numpy float64 references
in ``tests/losses_reference.py`` (``tests/parity/test_ppo_losses.py``,
``test_policy_losses.py``). Inputs are cast to float32. The clip arguments (``dual_clip``,
``value_clip``), ``estimator`` and the objective are static Python values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strop.objectives.losses import ArrayOps

F32 = jnp.float32


def _f32(x) -> jax.Array:
    return jnp.asarray(x, dtype=F32)


def _on(mask) -> jax.Array:
    return jnp.asarray(mask) > 0


def _select(on: jax.Array, x) -> jax.Array:
    """``x`` (as float32) where ``on``, else 0: masked columns never reach a non-linear op,
    so NaN/Inf there reach neither the result nor its gradient."""
    return jnp.where(on, _f32(x), 0.0)


def entropy_from_logits(logits) -> jax.Array:
    """Entropy ``[B, L]`` of ``softmax(logits [B, L, V])`` per column, in float32
    (column ``j`` is the distribution of ``x_{j+1}``: shift right to align)."""
    logp = jax.nn.log_softmax(_f32(logits), axis=-1)
    return -(jnp.exp(logp) * logp).sum(axis=-1)


def _shift(per_column: jax.Array) -> jax.Array:
    """``[B, L-1]`` values about ``x_1..x_{L-1}`` -> ``[B, L]`` with column 0 = 0."""
    return jnp.pad(per_column, ((0, 0), (1, 0)))


def token_logprobs(logits: jax.Array, input_ids: jax.Array, temperature: float) -> jax.Array:
    """``[B, L]``: ``log softmax(logits / T)`` of ``x_t`` from the logits at ``t - 1``."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(F32) / temperature, axis=-1)
    chosen = jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    return _shift(chosen)


def token_entropy(logits: jax.Array, temperature: float) -> jax.Array:
    """``[B, L]``: the entropy of ``softmax(logits / T)`` at ``t - 1``, column ``t``."""
    return _shift(entropy_from_logits(logits[:, :-1] / temperature))


def segment_mean(x: jax.Array, segments: jax.Array, on: jax.Array) -> jax.Array:
    """On each ``on`` token, the mean of ``x`` over the ``on`` tokens of its row with its
    segment id (:attr:`~strop.objectives.losses.ArrayOps.segment_mean`); 0 elsewhere."""
    rows, columns = x.shape
    keys = jnp.arange(rows)[:, None] * (columns + 1) + jnp.clip(segments, 0, columns)
    keys, count = keys.reshape(-1), rows * (columns + 1)
    sums = jax.ops.segment_sum(_select(on, x).reshape(-1), keys, num_segments=count)
    tokens = jax.ops.segment_sum(on.astype(F32).reshape(-1), keys, num_segments=count)
    means = (sums / jnp.maximum(tokens, 1.0))[keys].reshape(rows, columns)
    return jnp.where(on, means, 0.0)


OPS = ArrayOps(
    xp=jnp, on=_on, select=_select, indicator=lambda b: b.astype(F32),
    stop_gradient=jax.lax.stop_gradient, token_logprobs=token_logprobs,
    token_entropy=token_entropy, segment_mean=segment_mean,
)  # fmt: skip
