"""The JAX backend's sampler: a preallocated KV cache, prefill, then a ``while_loop`` decode.

:func:`generate` implements the contract of :mod:`strop.generation` for a
:class:`~strop.backends.jax.model.CausalLM` (LoRA-wrapped or not) on a mesh.

Layout and positions
--------------------
The batch is padded with dummy rows to a multiple of the mesh's batch shards (``data x
fsdp``) and the prompts are left-padded to a bucket ``P``: the longest prompt rounded up
to a power of two, at least :data:`MIN_PROMPT_BUCKET`, or the caller's fixed
``prompt_columns`` (the PPO actor's one width for a run). Each row's position ids count
from its first real token: a prompt of ``n`` tokens holds positions ``0 .. n-1`` in columns
``P-n .. P-1`` and the ``t``-th generated token (``t = 0, 1, ...``) has position ``n + t``
whatever the padding, the same convention as the training forward, so a row's tokens do
not depend on the other rows (except under RoPE tables chosen by the batch's longest row,
longrope and dynamic: :mod:`strop.backends.jax.rope`; at longrope's switch the decode loop
recomputes the whole cache, as transformers' Phi-3 ``generate`` does).

The cache (:class:`~strop.backends.jax.model.KVCache`) has ``P + max_new_tokens - 1``
slots per row, ``[B, slots, kv_heads, head_dim]`` per layer, sharded over the batch and the
KV heads where the mesh divides them. The prefill writes slots ``0 .. P-1``; decode step
``t`` feeds the token sampled at step ``t - 1`` and writes slot ``P + t - 1`` (the last
sampled token is never fed back, hence the ``- 1``). The cache's mask is 0 on the prompt
padding, so padding is never attended to; causality hides slots not written yet.

Compilation
-----------
Two jitted functions: the prefill (which also samples the first token) and the decode
loop (a ``jax.lax.while_loop`` over the remaining tokens that stops as soon as every row
is done, with no host round trip). Each compiles once per (batch, prompt bucket,
``max_new_tokens``, temperature/top-k/top-p, model structure, mesh); :data:`TRACES` counts
their traces. The cache is donated to the decode loop, which updates it in place.

Sampling
--------
One token per row from the last column's logits (:mod:`strop.backends.jax.sampling`); the
key of step ``t`` is ``fold_in(key(seed), t)``: the same seed gives the same tokens, on
any mesh.

A row stops after emitting any of ``eos_ids`` (the EOS is kept and counted) or after
``max_new_tokens``. Finished rows keep being fed (their outputs are discarded) until every
row is done.

Stop strings are applied on the host after generation: each row is decoded with the
tokenizer and cut after the first token at which its decoded text contains a stop string
(finish reason ``"stop"``); the cut token is kept, so the text may run a few characters
past the stop string when a token straddles it. This is simple and exact, at the price of
generating past a stop string until EOS or ``max_new_tokens``; stopping on device would
need incremental detokenization inside the loop.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strop.backends.jax.model import CausalLM, KVCache
from strop.backends.jax.rope import cache_reset_position
from strop.backends.jax.sampling import Sampling, sample_token
from strop.backends.jax.sharding import (
    batch_sharding,
    inference_layout,
    logical_to_sharding,
    make_mesh,
    put_rows,
    to_host,
)
from strop.generation import (
    Decoder,
    Decoding,
    FinishReason,
    Generation,
    SamplingParams,
    check_generate_args,
    finished,
    prompt_repeats,
)

MIN_PROMPT_BUCKET = 16
"""Prompts are left-padded to a power of two of at least this many tokens."""


@dataclass
class GenerateTraces:
    """How often the prefill and the decode loop were traced (= compiled), for tests/logs."""

    prefill: int = 0
    decode: int = 0


TRACES = GenerateTraces()


class _DecodeState(NamedTuple):
    """The decode loop's carry, besides the cache.

    ``tokens``/``logprobs`` ``[B, T]`` are filled column by column (``pad_id``/0 for rows
    already done); ``lengths [B]`` counts each row's tokens up to and including its EOS;
    ``step`` is the number of tokens sampled so far; ``positions [B]`` is the position id
    of the token fed at the next step.
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    done: jax.Array
    step: jax.Array
    positions: jax.Array


def generate(
    model: CausalLM,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    seed: int,
    mesh: Mesh | None = None,
    tokenizer: Decoder | None = None,
    prompt_columns: int | None = None,
) -> Generation:
    """Sample a response to each (ragged, non-empty) prompt (see the module docstring for
    the details); the arguments but these are :class:`~strop.generation.Decoding`'s.

    Args:
      model: the policy; its weights may be sharded on ``mesh``.
      mesh: where the inputs and the cache go; default: the mesh of the model's weights.
      prompt_columns: left-pad the prompts to this many columns instead of their bucket,
        so that every batch of a run has one shape and compiles once (the PPO actor passes
        its run's width, :class:`strop.batch.columns.FixedWidths`); ignored when a prompt
        is longer.

    Returns:
      A :class:`~strop.generation.Generation` of numpy arrays, ``len(prompts)`` rows.
    """
    check_generate_args(prompts, params, tokenizer)
    decoding = Decoding(seed, tuple(eos_ids), pad_id, tokenizer)
    mesh = mesh if mesh is not None else _mesh_of(model)
    model = inference_layout(model)  # freed when this call returns
    # a prompt's rollouts side by side: prefill it once (rows still split over the shards)
    repeats = prompt_repeats(prompts)
    if (len(prompts) // repeats) % (mesh.shape["data"] * mesh.shape["fsdp"]):
        repeats = 1
    ids, mask, active = _pad_prompts(prompts[::repeats], pad_id, mesh, prompt_columns)

    def put(rows: np.ndarray) -> jax.Array:
        return put_rows(rows, mesh)

    inputs = _decode_inputs(params, decoding, mesh)
    active = put(np.repeat(active, repeats))
    cache, state = _prefill(model, put(ids), put(mask), active, inputs, mesh, repeats)
    if params.max_new_tokens > 1:
        _, state = _decode(model, cache, state, inputs, mesh, put(np.repeat(ids, repeats, 0)))
    return _finished(state, len(prompts), params, decoding)


def prompt_bucket(length: int) -> int:
    """The padded prompt width for a longest prompt of ``length`` tokens: the next power
    of two, at least :data:`MIN_PROMPT_BUCKET`."""
    return max(MIN_PROMPT_BUCKET, 1 << max(length - 1, 0).bit_length())


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["eos", "pad", "key"],
    meta_fields=["sampling", "max_new_tokens"],
)
@dataclass(frozen=True)
class _DecodeInputs:
    """What every prefill and decode call takes besides the rows (:func:`_decode_inputs`):
    the EOS ids (:func:`_eos_array`), the pad id and the PRNG key, replicated on the mesh,
    and the static :class:`Sampling` and ``max_new_tokens`` (another value, another
    compile)."""

    eos: jax.Array
    pad: jax.Array
    key: jax.Array
    sampling: Sampling
    max_new_tokens: int


def _decode_inputs(params: SamplingParams, decoding: Decoding, mesh: Mesh) -> _DecodeInputs:
    """The :class:`_DecodeInputs` of one call, on ``mesh``."""
    replicated = NamedSharding(mesh, PartitionSpec())
    eos = jax.device_put(_eos_array(decoding.eos_ids), replicated)
    pad = jax.device_put(np.int32(decoding.pad_id), replicated)
    # Through the host: a device array cannot be put on other processes' devices.
    key_data = np.asarray(jax.random.key_data(jax.random.key(decoding.seed)))
    key = jax.random.wrap_key_data(jax.device_put(key_data, replicated))
    sampling = Sampling(float(params.temperature), int(params.top_k), float(params.top_p))
    return _DecodeInputs(eos, pad, key, sampling, params.max_new_tokens)


def _finished(
    state: _DecodeState, rows: int, params: SamplingParams, decoding: Decoding
) -> Generation:
    """The first ``rows`` rows of a decode loop's ``state`` (the dummy rows cut off) as a
    :class:`~strop.generation.Generation` of host arrays, stop strings applied."""
    # Writable host copies (stop strings edit them in place).
    on_host = (to_host(x) for x in (state.tokens, state.logprobs, state.lengths))
    tokens, logprobs, lengths = (np.array(x[:rows]) for x in on_host)
    eos = {int(e) for e in decoding.eos_ids}
    reasons: list[FinishReason] = [
        "stop" if n > 0 and int(row[n - 1]) in eos else "length"
        for row, n in zip(tokens, lengths, strict=True)
    ]
    return finished(tokens, logprobs, lengths, reasons, params, decoding.tokenizer, decoding.pad_id)


def _eos_array(eos_ids: Sequence[int]) -> np.ndarray:
    """The EOS ids padded with -1 (never sampled) to a power of two, at least 4, so that
    EOS sets of different sizes rarely mean another compile."""
    eos = [int(e) for e in eos_ids]
    size = max(4, 1 << max(len(eos) - 1, 0).bit_length())
    return np.asarray(eos + [-1] * (size - len(eos)), dtype=np.int32)


def _mesh_of(model: CausalLM) -> Mesh:
    """The mesh the model's weights live on (a one-device mesh for unsharded weights)."""
    sharding = jax.tree.leaves(nnx.state(model, nnx.Param))[0].sharding
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    return make_mesh({"fsdp": 1}, devices=list(sharding.device_set))


def _pad_prompts(
    prompts: list[list[int]], pad_id: int, mesh: Mesh, columns: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-padded ``ids [B', P]``, ``mask [B', P]`` and ``active [B']`` (False on dummy rows).

    ``B'`` is ``len(prompts)`` rounded up to a multiple of the mesh's batch shards; dummy
    rows hold one real pad token (so that attention is never empty) and start done. ``P``
    is ``columns`` when given and no prompt is longer, else the longest prompt's bucket.
    """
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    batch = math.ceil(len(prompts) / shards) * shards
    longest = max(len(p) for p in prompts)
    width = columns if columns is not None and columns >= longest else prompt_bucket(longest)
    ids = np.full((batch, width), pad_id, dtype=np.int32)
    mask = np.zeros((batch, width), dtype=np.int32)
    mask[len(prompts) :, -1] = 1
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    active = np.arange(batch) < len(prompts)
    return ids, mask, active


def _constrain_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """Pin the cache's sharding: batch over ``data x fsdp``, KV heads over ``tensor``."""
    kv_shape = cache.layers[0][0].shape
    kv = logical_to_sharding(("batch", None, "kv_heads", "head_dim"), kv_shape, mesh)
    constrain = jax.lax.with_sharding_constraint
    return KVCache(
        layers=tuple((constrain(k, kv), constrain(v, kv)) for k, v in cache.layers),
        mask=constrain(cache.mask, batch_sharding(cache.mask.shape, mesh)),
        index=cache.index,
    )


def _record(
    state: _DecodeState, token: jax.Array, logprob: jax.Array, inputs: _DecodeInputs
) -> _DecodeState:
    """Write the token sampled at ``state.step`` (the pad id for rows already done)."""
    live = ~state.done
    token = jnp.where(live, token.astype(jnp.int32), inputs.pad)
    logprob = jnp.where(live, logprob, 0.0)
    column = state.step
    stopped = live & jnp.any(token[:, None] == inputs.eos[None, :], axis=-1)
    return state._replace(
        tokens=jax.lax.dynamic_update_slice_in_dim(state.tokens, token[:, None], column, 1),
        logprobs=jax.lax.dynamic_update_slice_in_dim(state.logprobs, logprob[:, None], column, 1),
        lengths=jnp.where(live, column + 1, state.lengths),
        done=state.done | stopped,
        step=column + 1,
    )


@nnx.jit(static_argnums=(5, 6))
def _prefill(
    model: CausalLM,
    ids: jax.Array,
    mask: jax.Array,
    active: jax.Array,
    inputs: _DecodeInputs,
    mesh: Mesh,
    repeats: int = 1,
) -> tuple[KVCache, _DecodeState]:
    """Fill a fresh cache with the prompts and sample the first token; with ``repeats``,
    each prompt stands for that many rows side by side, which get copies of its cache."""
    TRACES.prefill += 1
    span = ids.shape[1] + inputs.max_new_tokens - 1
    cache = _constrain_cache(model.init_cache(len(ids), span), mesh)
    out = model(ids, mask, cache=cache, logits_to_keep=1)
    cache, logits = out.cache, out.logits[:, -1]
    if repeats > 1:
        rows = functools.partial(jnp.repeat, repeats=repeats, axis=0)
        layers = tuple((rows(k), rows(v)) for k, v in cache.layers)
        cache = KVCache(layers, rows(cache.mask), cache.index)
        logits, mask = rows(logits), rows(mask)
    positions = mask.sum(axis=-1, dtype=jnp.int32)
    return _constrain_cache(cache, mesh), _first_state(logits, active, positions, inputs)


def _first_state(
    logits: jax.Array, active: jax.Array, positions: jax.Array, inputs: _DecodeInputs
) -> _DecodeState:
    """A prefill's decode state: the first token sampled from its last ``logits [B, V]``,
    recorded for the ``active`` rows; ``positions [B]``: the position id of the token fed
    next."""
    token, logprob = sample_token(logits, jax.random.fold_in(inputs.key, 0), inputs.sampling)
    batch, steps = len(token), inputs.max_new_tokens
    state = _DecodeState(
        tokens=jnp.full((batch, steps), inputs.pad, dtype=jnp.int32),
        logprobs=jnp.zeros((batch, steps), dtype=jnp.float32),
        lengths=jnp.zeros((batch,), dtype=jnp.int32),
        done=~active,
        step=jnp.zeros((), dtype=jnp.int32),
        positions=positions,
    )
    return _record(state, token, logprob, inputs)


@nnx.jit(static_argnums=(4,), donate_argnums=(1,))
def _decode(
    model: CausalLM,
    cache: KVCache,
    state: _DecodeState,
    inputs: _DecodeInputs,
    mesh: Mesh,
    prompt_ids: jax.Array | None = None,
) -> tuple[KVCache, _DecodeState]:
    """Sample the remaining tokens, one forward per step, until every row is done.

    The cache is returned so that its donated buffers can be updated in place. With the
    prompts' ``prompt_ids [B, P]`` (the prefill's columns), the step whose largest position
    is the model's :func:`~strop.backends.jax.rope.cache_reset_position` first recomputes
    the whole cache (:func:`_recomputed_cache`), as transformers' ``generate`` does there.
    """
    TRACES.decode += 1
    # The step forward runs on a model merged inside the loop body's trace: an adapter
    # library may set attributes on modules during a call (Qwix LoRA does), which NNX
    # forbids on modules of an outer trace.
    graphdef, weights = nnx.split(model)
    reset = cache_reset_position(model.spec)
    if prompt_ids is None or reset is None or reset >= cache.mask.shape[1]:
        reset = None  # or no position of this call reaches it: nothing to compile

    def recomputed(cache: KVCache, state: _DecodeState) -> KVCache:
        return _recomputed_cache(nnx.merge(graphdef, weights), prompt_ids, state, cache, mesh)

    def not_finished(carry: tuple[KVCache, _DecodeState]) -> jax.Array:
        _, state = carry
        return (state.step < inputs.max_new_tokens) & ~jnp.all(state.done)

    def step(carry: tuple[KVCache, _DecodeState]) -> tuple[KVCache, _DecodeState]:
        cache, state = carry
        if reset is not None:
            at_reset = jnp.max(state.positions) == reset
            cache = jax.lax.cond(at_reset, recomputed, lambda c, _: c, cache, state)
        fed = jax.lax.dynamic_slice_in_dim(state.tokens, state.step - 1, 1, axis=1)
        out = nnx.merge(graphdef, weights)(fed, positions=state.positions[:, None], cache=cache)
        key = jax.random.fold_in(inputs.key, state.step)
        token, logprob = sample_token(out.logits[:, -1], key, inputs.sampling)
        state = _record(state._replace(positions=state.positions + 1), token, logprob, inputs)
        return _constrain_cache(out.cache, mesh), state

    return jax.lax.while_loop(not_finished, step, (cache, state))


def _recomputed_cache(
    model: CausalLM, prompt_ids: jax.Array, state: _DecodeState, cache: KVCache, mesh: Mesh
) -> KVCache:
    """``cache`` recomputed from scratch: the prompts, the tokens fed so far and the one
    fed now (slot ``cache.index``) in one forward, whose RoPE tables are then the ones
    this step's positions choose; its index left at ``cache.index``, for the step's own
    forward to write that slot again and sample from it."""
    feeding = jnp.ones((len(prompt_ids), 1), jnp.bool_)
    mask = jax.lax.dynamic_update_slice_in_dim(cache.mask, feeding, cache.index, 1)
    ids = jnp.concatenate([prompt_ids, state.tokens[:, :-1]], axis=1)  # one per slot
    fresh = _constrain_cache(model.init_cache(*mask.shape), mesh)
    out = model(ids, mask, cache=fresh, logits_to_keep=1)
    return _constrain_cache(out.cache._replace(index=cache.index), mesh)
