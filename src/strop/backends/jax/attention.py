"""Grouped-query attention for :mod:`strop.backends.jax.model`: softmax(scale * q k^T) v
under a boolean mask, the scores and the softmax in float32.

Queries come as ``[B, L, K, G, D]`` (K kv heads, G query heads per kv head) and keys and
values as ``[B, S, K, D]``; the output is ``[B, L, K, G, D]``. Two forms of the same sum:
:func:`cached_attention` over a KV cache's slots (a prefill or a decode step), and
:func:`causal_attention` over the L tokens themselves (the training and scoring forwards),
which skips the keys after each block of queries.

Which keys a query sees is an :class:`AttentionMask`, built once per forward
(:func:`sequence_mask` or :func:`cache_mask`) and narrowed by each layer to its sliding
window, if it has one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from strop.batch.packing import PREFIX_STRIDE

ATTENTION_BLOCK = 64
"""Queries per block of :func:`causal_attention`."""


class AttentionMask(NamedTuple):
    """Which keys each query may see, for every layer of one forward.

    ``visible [B, Lq, Lk]``: causality, padding and packed segments. A sliding window of
    ``w`` (transformers' ``kv_idx > q_idx - w``) narrows it to the keys whose position is
    after the query's minus ``w``: ``query_positions [B, Lq]`` and ``key_positions
    [B, Lk]`` are the tokens' positions in their own sequence (up to an offset per row
    shared by its queries and keys), so a packed segment's window is its own row's.
    """

    visible: jax.Array
    query_positions: jax.Array
    key_positions: jax.Array

    def within(self, window: int | None) -> jax.Array:
        """The ``[B, Lq, Lk]`` mask of a layer attending over ``window`` positions (the
        query's own included), or over all of ``visible`` for ``None``."""
        if window is None:
            return self.visible
        near = self.key_positions[:, None, :] > self.query_positions[:, :, None] - window
        return self.visible & near


def sequence_mask(attention_mask: jax.Array, positions: jax.Array) -> AttentionMask:
    """The mask of a full-sequence forward of ``[B, L]`` tokens at ``positions``.

    ``attention_mask`` holds segment ids (0: padding; a plain 0/1 mask is one segment), each
    plus ``PREFIX_STRIDE`` times the segment of the shared prompt it sees too (see
    :mod:`strop.batch.packing`): a real token sees the earlier real tokens of both.
    """
    segments, prefixes = attention_mask % PREFIX_STRIDE, attention_mask // PREFIX_STRIDE
    real = segments != 0
    length = attention_mask.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    # a padding query sees every real key: its softmax stays finite, its output unused
    own = (
        (segments[:, :, None] == segments[:, None, :])
        | (prefixes[:, :, None] == segments[:, None, :])
        | ~real[:, :, None]
    )
    visible = causal[None, :, :] & real[:, None, :] & own
    return AttentionMask(visible, positions, positions)


def cache_mask(valid: jax.Array, index: jax.Array, length: int) -> AttentionMask:
    """The mask of ``length`` queries written at slots ``index ..`` of a cache whose slots
    hold real tokens where ``valid [B, S]`` (the queries' own slots included).

    A query sees the real slots up to its own. A slot's position, for the windows, is the
    count of real slots up to it: a row's real tokens count positions one by one in the
    cache (:class:`~strop.backends.jax.model.KVCache`), so the difference of two counts is
    the difference of their positions, whatever padding lies between.
    """
    query_slots = index + jnp.arange(length)
    causal = jnp.arange(valid.shape[1])[None, :] <= query_slots[:, None]  # [Lq, S]
    counts = jnp.cumsum(valid, axis=1, dtype=jnp.int32)
    return AttentionMask(
        causal[None, :, :] & valid[:, None, :], jnp.take(counts, query_slots, axis=1), counts
    )


def _scores(
    q: jax.Array, k: jax.Array, spec: str, scale: float, softcap: float | None
) -> jax.Array:
    """``scale * q k^T`` (``einsum(spec, q, k)``) in float32, soft-capped to ``(-softcap,
    softcap)`` by ``softcap * tanh(x / softcap)`` when given (Gemma's attention logits)."""
    scores = jnp.einsum(spec, q, k).astype(jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    return scores


def _blocks(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float, softcap: float | None
) -> jax.Array:
    """Causal attention of ``q [B, K, G, L, D]`` over ``k``, ``v [B, K, L, D]`` under
    ``mask [B, L, L]`` (never true above the diagonal), softmax in float32.

    The queries go in blocks of :data:`ATTENTION_BLOCK` (at most eight blocks), each over
    the keys up to its last query only: the keys after it are masked for all of them
    (their weights are exactly 0), so the block skips them, about half of the work. The
    head axes come before the sequence axes: XLA:CPU runs these batched products several
    times faster than with the heads between them (5x for a forward and backward on
    ``[8, 256]`` packed rows of the demo's model).
    """
    length = q.shape[3]
    step = max(ATTENTION_BLOCK, -(-length // 8))
    blocks = []
    for lo in range(0, length, step):
        hi = min(lo + step, length)
        block = q[:, :, :, lo:hi]
        scores = _scores(block, k[:, :, :hi], "bkgqd,bksd->bkgqs", scale, softcap)
        visible = mask[:, None, None, lo:hi, :hi]
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        blocks.append(jnp.einsum("bkgqs,bksd->bkgqd", probs, v[:, :, :hi]))
    return jnp.concatenate(blocks, axis=3)


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
) -> jax.Array:
    """Attention of ``q [B, L, K, G, D]`` over a cache's ``k``, ``v [B, S, K, D]`` under
    ``mask [B, L, S]``; ``[B, L, K, G, D]``."""
    scores = _scores(q, k, "bqkgd,bskd->bkgqs", scale, softcap)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
) -> jax.Array:
    """Attention of ``q [B, L, K, G, D]`` over the same L tokens' ``k``, ``v [B, L, K, D]``
    under ``mask [B, L, L]``, never true above the diagonal; ``[B, L, K, G, D]``."""
    out = _blocks(
        q.transpose(0, 2, 3, 1, 4),
        k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3),
        mask,
        scale,
        softcap,
    )
    return out.transpose(0, 3, 1, 2, 4)
