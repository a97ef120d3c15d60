"""Grouped-query attention for :mod:`strop.backends.jax.model`: softmax(q k^T / sqrt(D)) v
under a boolean mask, the softmax in float32.

Queries come as ``[B, L, K, G, D]`` (K kv heads, G query heads per kv head) and keys and
values as ``[B, S, K, D]``; the output is ``[B, L, K, G, D]``. Two forms of the same sum:
:func:`cached_attention` over a KV cache's slots (a prefill or a decode step), and
:func:`causal_attention` over the L tokens themselves (the training and scoring forwards),
which skips the keys after each block of queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ATTENTION_BLOCK = 64
"""Queries per block of :func:`causal_attention`."""


def _blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Causal attention of ``q [B, K, G, L, D]`` over ``k``, ``v [B, K, L, D]`` under
    ``mask [B, L, L]`` (never true above the diagonal), softmax in float32.

    The queries go in blocks of :data:`ATTENTION_BLOCK` (at most eight blocks), each over
    the keys up to its last query only: the keys after it are masked for all of them
    (their weights are exactly 0), so the block skips them, about half of the work. The
    head axes come before the sequence axes: XLA:CPU runs these batched products several
    times faster than with the heads between them (5x for a forward and backward on
    ``[8, 256]`` packed rows of the demo's model).
    """
    length, d = q.shape[3], q.shape[4]
    step = max(ATTENTION_BLOCK, -(-length // 8))
    blocks = []
    for lo in range(0, length, step):
        hi = min(lo + step, length)
        scores = jnp.einsum("bkgqd,bksd->bkgqs", q[:, :, :, lo:hi], k[:, :, :hi])
        scores = scores.astype(jnp.float32) / np.sqrt(d)
        visible = mask[:, None, None, lo:hi, :hi]
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        blocks.append(jnp.einsum("bkgqs,bksd->bkgqd", probs, v[:, :, :hi]))
    return jnp.concatenate(blocks, axis=3)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention of ``q [B, L, K, G, D]`` over a cache's ``k``, ``v [B, S, K, D]`` under
    ``mask [B, L, S]``; ``[B, L, K, G, D]``."""
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention of ``q [B, L, K, G, D]`` over the same L tokens' ``k``, ``v [B, L, K, D]``
    under ``mask [B, L, L]``, never true above the diagonal; ``[B, L, K, G, D]``."""
    out = _blocks(
        q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask
    )
    return out.transpose(0, 3, 1, 2, 4)
