"""The JAX sampler, continuing from a KV cache kept across calls (multi-turn episodes).

A :class:`JaxContinuation` implements :class:`strop.agents.continuation.Continuation`: it
keeps a *store*, one cache row per slot, ``[E, M, K, D]`` per layer, a slot's ids at
columns ``0, 1, ...`` (left-aligned). A call lays its rows out exactly as
:func:`~strop.backends.jax.generate.generate` does (left-padded to the prompt width ``P``,
the same rows, batch and cache of ``W = P + max_new_tokens - 1`` slots), so its random
draws and its decode loop (the same compiled ``_decode``) are re-prefill's; only the
prefill differs: each row's cached ids are copied from its slot into the columns they
would have (a per-row shift), and just the last ``C`` columns are run through the model,
``C`` the smallest power of two (at least 16, at most ``P``) that covers every row's ids
not cached. After decoding, each row's cache is shifted back into its slot.

Compilation: the chunk prefill compiles per (batch, ``C``, ``W``, store shape), the store
per (batch, ``W``, store shape), the decode loop as re-prefill's (shared compiles). With a
fixed prompt width (the PPO actor's) a round of episodes costs one compile of each per
batch bucket and per chunk bucket (the first turn's ``C`` is its prompts' bucket, later
turns' the bucket of the environment's messages): :data:`CONTINUATION_TRACES` counts them.
The store grows (zeros, a new shape) when a call needs more slots or columns.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strop.agents.continuation import SlotAssignment
from strop.backends.jax.generate import (
    _constrain_cache,
    _decode,
    _decode_inputs,
    _DecodeInputs,
    _DecodeState,
    _finished,
    _first_state,
    _mesh_of,
    prompt_bucket,
)
from strop.backends.jax.model import CausalLM, KVCache
from strop.backends.jax.sharding import inference_layout, put_rows
from strop.generation import Decoding, Generation, SamplingParams, check_generate_args


@dataclass
class ContinuationTraces:
    """How often the chunk prefill and the store were traced (= compiled)."""

    prefill: int = 0
    store: int = 0


CONTINUATION_TRACES = ContinuationTraces()


class JaxContinuation:
    """A session of the JAX sampler (:class:`strop.agents.continuation.Continuation`).

    ``model``: returns the policy module at each call; ``prompt_columns``: the fixed prompt
    width :func:`~strop.backends.jax.generate.generate` would be given."""

    def __init__(
        self,
        model: Callable[[], CausalLM],
        decoding: Decoding,
        *,
        prompt_columns: int | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        self.model, self.decoding = model, decoding
        self.prompt_columns, self.mesh = prompt_columns, mesh
        self.store: KVCache | None = None

    def generate(
        self, prefixes: list[list[int]], params: SamplingParams, seed: int, rows: SlotAssignment
    ) -> Generation:
        slots, cached = rows.slots, rows.cached
        decoding = self.decoding
        check_generate_args(prefixes, params, decoding.tokenizer)
        model = self.model()
        mesh = self.mesh if self.mesh is not None else _mesh_of(model)
        model = inference_layout(model)
        shards = mesh.shape["data"] * mesh.shape["fsdp"]
        n = len(prefixes)
        batch = math.ceil(n / shards) * shards
        longest = max(len(p) for p in prefixes)
        columns = self.prompt_columns
        width = columns if columns is not None and columns >= longest else prompt_bucket(longest)
        steps = params.max_new_tokens
        span = width + steps - 1  # the cache's slots per row, as re-prefill's
        reused = [  # nothing before the first call, nor without a slot
            max(0, min(int(c), len(p) - 1)) if self.store is not None and s >= 0 else 0
            for c, p, s in zip(cached, prefixes, slots, strict=True)
        ]
        chunk = min(
            width, prompt_bucket(max(len(p) - c for p, c in zip(prefixes, reused, strict=True)))
        )
        store = self._store_for(model, max(max(slots, default=-1) + 1, batch), span, mesh, shards)
        rows = store.layers[0][0].shape[0]

        ids = np.full((batch, chunk), decoding.pad_id, dtype=np.int32)
        full = np.full((batch, width), decoding.pad_id, dtype=np.int32)  # every id, re-prefill's
        mask = np.zeros((batch, chunk), dtype=np.int32)
        positions = np.zeros((batch, chunk), dtype=np.int32)
        offsets = np.full(batch, width - 1, dtype=np.int32)  # where each row's ids begin
        lengths = np.ones(batch, dtype=np.int32)
        slot_of = np.full(batch, rows, dtype=np.int32)  # out of range: nothing read or kept
        mask[n:, -1] = 1  # dummy rows: one real pad token, done from the start
        for r, prefix in enumerate(prefixes):
            take = min(len(prefix), chunk)
            ids[r, chunk - take :] = prefix[-take:]
            full[r, width - len(prefix) :] = prefix
            mask[r, chunk - take :] = 1
            positions[r, chunk - take :] = np.arange(len(prefix) - take, len(prefix))
            offsets[r], lengths[r] = width - len(prefix), len(prefix)
            if slots[r] >= 0:
                slot_of[r] = slots[r]
        column = np.arange(span)[None, :]
        held = (column >= offsets[:, None]) & (column < width - chunk)  # cached ids' columns

        def put(array: np.ndarray) -> jax.Array:
            return put_rows(array, mesh)

        inputs = _decode_inputs(params, dataclasses.replace(decoding, seed=seed), mesh)
        cache, state = _chunk_prefill(
            model, store, put(ids), put(mask), put(positions), put(held), put(slot_of),
            put(offsets), put(lengths), put(np.arange(batch) < n), inputs, mesh,
        )  # fmt: skip
        if steps > 1:
            cache, state = _decode(model, cache, state, inputs, mesh, put(full))
        self.store = _keep(store, cache, put(slot_of), put(offsets), mesh)
        return _finished(state, n, params, decoding)

    def _store_for(self, model: CausalLM, rows: int, span: int, mesh: Mesh, shards: int) -> KVCache:
        """The store, grown (zeros) to at least ``rows`` slots of ``span`` columns (its index
        replicated on the mesh, as :func:`_keep` returns it: one trace for both)."""
        rows = math.ceil(rows / shards) * shards
        index = jax.device_put(np.int32(0), NamedSharding(mesh, PartitionSpec()))
        if self.store is None:
            return _constrain_cache(model.init_cache(rows, span)._replace(index=index), mesh)
        have_rows, have_span = self.store.mask.shape
        if have_rows >= rows and have_span >= span:
            return self.store
        grow = ((0, max(rows - have_rows, 0)), (0, max(span - have_span, 0)), (0, 0), (0, 0))
        layers = tuple((jnp.pad(k, grow), jnp.pad(v, grow)) for k, v in self.store.layers)
        mask = jnp.zeros((have_rows + grow[0][1], have_span + grow[1][1]), jnp.bool_)
        return _constrain_cache(KVCache(layers, mask, index), mesh)


def _shift_rows(rows: jax.Array, starts: jax.Array, width: int) -> jax.Array:
    """Row ``b`` of ``rows [B, S, ...]`` from column ``starts[b]``, ``width`` columns (zeros
    past its end); ``starts`` in ``[0, S]``."""
    pad = [(0, 0), (0, width)] + [(0, 0)] * (rows.ndim - 2)
    padded = jnp.pad(rows, pad)
    return jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, width, 0))(
        padded, starts
    )


@nnx.jit(static_argnums=(11,))
def _chunk_prefill(
    model: CausalLM,
    store: KVCache,
    ids: jax.Array,
    mask: jax.Array,
    positions: jax.Array,
    held: jax.Array,
    slots: jax.Array,
    offsets: jax.Array,
    lengths: jax.Array,
    active: jax.Array,
    inputs: _DecodeInputs,
    mesh: Mesh,
) -> tuple[KVCache, _DecodeState]:
    """A cache laid out as re-prefill's, its cached columns (``held``) copied from the
    slots, then the last ``C`` columns (``ids``) run through it; the first token sampled."""
    CONTINUATION_TRACES.prefill += 1
    span, chunk = held.shape[1], ids.shape[1]
    first = span - (inputs.max_new_tokens - 1) - chunk  # the chunk's first column: P - C

    def shift_in(x: jax.Array) -> jax.Array:  # slot column j -> cache column offset + j
        rows = jnp.take(x, slots, axis=0, mode="fill", fill_value=0)
        rows = jnp.pad(rows, [(0, 0), (span, 0), (0, 0), (0, 0)])
        return _shift_rows(rows, span - offsets, span)

    layers = tuple((shift_in(k), shift_in(v)) for k, v in store.layers)
    cache = _constrain_cache(KVCache(layers, held, jnp.int32(first)), mesh)
    out = model(ids, mask, positions, cache=cache, logits_to_keep=1)
    state = _first_state(out.logits[:, -1], active, lengths, inputs)
    return _constrain_cache(out.cache, mesh), state


@nnx.jit(static_argnums=(4,), donate_argnums=(0,))
def _keep(
    store: KVCache, cache: KVCache, slots: jax.Array, offsets: jax.Array, mesh: Mesh
) -> KVCache:
    """Each row's cache shifted back into its slot (cache column offset + j -> slot
    column j); rows whose slot is out of range are dropped."""
    CONTINUATION_TRACES.store += 1
    stored = store.mask.shape[1]

    def shift_out(old: jax.Array, new: jax.Array) -> jax.Array:
        rows = _shift_rows(new, offsets, stored)
        return old.at[slots].set(rows.astype(old.dtype), mode="drop")

    layers = tuple(
        (shift_out(k, ck), shift_out(v, cv))
        for (k, v), (ck, cv) in zip(store.layers, cache.layers, strict=True)
    )
    return _constrain_cache(KVCache(layers, store.mask, store.index), mesh)
