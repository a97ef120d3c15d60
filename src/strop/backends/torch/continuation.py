"""The torch sampler, continuing from a KV cache kept across calls (multi-turn episodes).

A :class:`TorchContinuation` implements :class:`strop.agents.continuation.Continuation`: it
keeps a *store*, one cache row per slot, ``keys``/``values [E, heads, M, dim]`` per layer,
a slot's ids at columns ``0, 1, ...``. A call lays its rows out exactly as
:func:`~strop.backends.torch.generate.generate` does (left-padded to the prompt width
``P``, a ``StaticCache`` of ``P + max_new_tokens - 1`` slots in every layer
(:func:`~strop.backends.torch.generate.static_kv_cache`), one attention mask, the same
per-row draws :func:`~strop.generation.row_uniforms` and the same decode loop), so it
samples what re-prefill samples; only the prefill differs: each row's cached ids are copied
from its slot into the columns they would have, the cache's write offset is set after them,
and just the last ``C`` columns are run through the model, ``C`` the ids no row has cached
rounded up to :data:`~strop.backends.torch.generate.PROMPT_BUCKET` (at most ``P``); when
no row has anything cached, a prompt's rollouts side by side are prefilled once (as
``generate`` does). After decoding, each row's cache is copied back into its slot. The
store grows (zeros) when a call needs more slots or columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from transformers import StaticCache

from strop.agents.continuation import SlotAssignment
from strop.backends.torch.generate import (
    PROMPT_BUCKET,
    _cache_keyword,
    _decode_loop,
    _forward,
    _repeat_rows,
    run_sampling,
    static_kv_cache,
)
from strop.generation import (
    Decoding,
    Generation,
    SamplingParams,
    check_generate_args,
    prompt_repeats,
    row_uniforms,
)

Scope = Callable[[], AbstractContextManager[tuple[torch.nn.Module, dict[str, Any]]]]
"""Enters the sampler's sampling context (autocast, the actor's role) and yields the model
and :func:`~strop.backends.torch.generate.sampler_keywords`' keywords."""


class TorchContinuation:
    """A session of the torch sampler (:class:`strop.agents.continuation.Continuation`)."""

    def __init__(self, scope: Scope, decoding: Decoding) -> None:
        self.scope, self.decoding = scope, decoding
        self.store: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def generate(
        self, prefixes: list[list[int]], params: SamplingParams, seed: int, rows: SlotAssignment
    ) -> Generation:
        slots, cached = rows.slots, rows.cached
        check_generate_args(prefixes, params, self.decoding.tokenizer)
        decoding = dataclasses.replace(self.decoding, seed=seed)
        with self.scope() as (model, keywords):
            mode, columns = keywords.get("compile_mode"), keywords.get("prompt_columns")

            def loop(device: torch.device) -> tuple[torch.Tensor, ...]:
                return self._loop(
                    model, prefixes, params, decoding, device, mode, columns, slots, cached
                )

            return run_sampling(model, params, decoding, loop)

    def _loop(
        self, model: torch.nn.Module, prefixes: list[list[int]], params: SamplingParams,
        decoding: Decoding, device: torch.device, compile_mode: str | None,
        prompt_columns: int | None, slots: Sequence[int], cached: Sequence[int],
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        batch, steps = len(prefixes), params.max_new_tokens
        longest = max(prompt_columns or 0, *(len(p) for p in prefixes))
        width = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
        span = width + steps - 1
        reused = [
            max(0, min(int(c), len(p) - 1)) if self.store is not None and s >= 0 else 0
            for c, p, s in zip(cached, prefixes, slots, strict=True)
        ]
        new = max(len(p) - c for p, c in zip(prefixes, reused, strict=True))
        chunk = min(width, -(-new // PROMPT_BUCKET) * PROMPT_BUCKET)
        first = width - chunk  # the chunk's first column; the cached ids end there
        offsets = [width - len(p) for p in prefixes]  # where each row's ids begin

        ids = torch.full((batch, chunk), decoding.pad_id, dtype=torch.long)
        positions = torch.zeros((batch, chunk), dtype=torch.long)
        for r, prefix in enumerate(prefixes):
            take = min(len(prefix), chunk)
            ids[r, chunk - take :] = torch.tensor(prefix[-take:], dtype=torch.long)
            positions[r, chunk - take :] = torch.arange(len(prefix) - take, len(prefix))
        lengths = torch.tensor([len(p) for p in prefixes], device=device)
        columns = torch.arange(span, device=device)
        attention_mask = (columns[None, :] >= (width - lengths)[:, None]).long()

        kv_cache = static_kv_cache(model, span)
        for index, layer in enumerate(kv_cache.layers):
            layer.cumulative_length.fill_(first)  # the chunk is written from there
            if self.store is None or first == 0:
                continue  # allocated by the forward, zeros
            keys, values = self.store[index]
            shape = (batch, keys.shape[1], 1, keys.shape[3])
            layer.lazy_initialization(
                keys[:1, :, :1].expand(shape), values[:1, :, :1].expand(shape)
            )
            for r, (slot, offset) in enumerate(zip(slots, offsets, strict=True)):
                held = first - offset  # ids of row r before the chunk, all cached
                if held > 0:
                    layer.keys[r, :, offset:first] = keys[slot, :, :held]
                    layer.values[r, :, offset:first] = values[slot, :, :held]

        uniforms = None
        if not params.greedy:
            uniforms = torch.from_numpy(row_uniforms(prefixes, decoding.seed, steps)).to(device)
        keyword = _cache_keyword(model)
        # nothing cached (a session's first call): a prompt's rollouts side by side are
        # prefilled once and its cache copied to its rows, as generate does
        repeats = prompt_repeats(prefixes) if first == 0 else 1
        once = slice(None, None, repeats)
        ids, positions = ids[once].to(device), positions[once].to(device)
        logits = _forward(model, kv_cache, ids, positions, attention_mask[once], keyword)
        if repeats > 1:
            _repeat_rows(kv_cache, repeats)
            logits = logits.repeat_interleave(repeats, 0)
        out = _decode_loop(
            model, kv_cache, logits, lengths[:, None].clone(), attention_mask, params, uniforms,
            decoding, compile_mode,
        )  # fmt: skip
        self._keep(kv_cache, slots, offsets, span)
        return out

    def _keep(
        self, kv_cache: StaticCache, slots: Sequence[int], offsets: list[int], span: int
    ) -> None:
        """Copy each row's cache back into its slot (grown as needed)."""
        rows = max(max(slots, default=-1) + 1, len(offsets))
        store = []
        for index, layer in enumerate(kv_cache.layers):
            pair = []
            for name, new in (("keys", layer.keys), ("values", layer.values)):
                old = None if self.store is None else self.store[index][name == "values"]
                if old is None or old.shape[0] < rows or old.shape[2] < span:
                    have = (0, 0) if old is None else (old.shape[0], old.shape[2])
                    shape = (max(rows, have[0]), new.shape[1], max(span, have[1]), new.shape[3])
                    grown = new.new_zeros(shape)
                    if old is not None:
                        grown[: have[0], :, : have[1]] = old
                    old = grown
                for r, (slot, offset) in enumerate(zip(slots, offsets, strict=True)):
                    if slot >= 0:
                        old[slot, :, : span - offset] = new[r, :, offset:]
                pair.append(old)
            store.append((pair[0], pair[1]))
        self.store = store
