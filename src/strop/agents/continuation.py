"""The ``generate(prefixes, max_new_tokens)`` engine of :func:`~strop.agents.rollout
.run_episodes` over a strop sampler: each turn continuing from the KV cache of the
episode's previous turn, or re-prefilling the whole prefix.

:func:`continuation_generate` makes one over a sampler that can keep its KV cache between
calls (the JAX and torch policies and actor-critics: ``sampler.start_session(decoding)``
returns a :class:`Continuation`); over any other sampler (vLLM), or with ``kv_cache``
off, it is :func:`sampler_generate`, which re-prefills every turn: the same tokens.

A session holds one cache row per *slot*, across the calls of one round of episodes. This
module keeps, on the host, the token ids each slot's cache holds (:class:`SlotTable`) and
assigns each call's prefixes to slots: an episode's prefix starts with what its slot
cached at its previous turn (the prefix then, plus the turn's sampled tokens but the last,
which was never fed back), so the sampler only prefills the rest: the last sampled token
and the environment's messages. ``run_episodes`` passes the running episodes in a fixed
order and drops finished ones, so slots are matched in order, each to the first unused
slot at or after the previous match whose cached ids are a prefix of the row's; a row with
no such slot (a turn cut by a stop string, a padding copy of a row) takes the unused slot
sharing the longest prefix with it (a finished episode's slot, freed) and reuses that much.
Whatever is matched, a slot is only ever reused for ids it holds, so continuing gives the
tokens re-prefilling does: the same random draws (the n-th call is seeded ``seed + n``,
the rows are laid out alike), logits equal up to float rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from strop.agents.rollout import Generate, Turn
from strop.generation import Decoding, Generation, SamplingParams


@dataclass(frozen=True)
class SlotAssignment:
    """Where a call's prefixes continue: ``slots[r]``, the cache row that holds row ``r``'s
    first ``cached[r]`` ids (from an earlier call) and then keeps what this call feeds it;
    -1: a row with no slot (nothing reused or kept)."""

    slots: list[int]
    cached: list[int]


class Continuation(Protocol):
    """A sampler's KV cache kept across calls (``sampler.start_session(decoding)``)."""

    def generate(
        self, prefixes: list[list[int]], params: SamplingParams, seed: int, rows: SlotAssignment
    ) -> Generation:
        """Sample after each prefix, as the sampler's ``generate`` would at ``seed``; only
        the part of each prefix its slot does not hold is prefilled (``rows``). After the
        call slot ``rows.slots[r]`` holds the prefix and the row's sampled tokens but the
        last."""
        ...


class SlotTable:
    """The ids each slot of a session's cache holds, and which slot each prefix continues."""

    def __init__(self) -> None:
        self.held: list[np.ndarray] = []

    def assign(self, prefixes: Sequence[Sequence[int]]) -> SlotAssignment:
        """Each prefix's slot and how many of its leading ids the slot holds (at most all
        but its last id: the last is fed to get the next token's logits); see the module
        docstring. New slots are made as needed, one per row at most."""
        rows = [np.asarray(p, dtype=np.int64) for p in prefixes]
        while len(self.held) < len(rows):
            self.held.append(np.zeros(0, dtype=np.int64))
        slots, cached = [-1] * len(rows), [0] * len(rows)
        used: set[int] = set()
        after = 0
        for r, ids in enumerate(rows):  # in order, each to a slot holding a prefix of it
            for s in range(after, len(self.held)):
                held = self.held[s]
                if s not in used and 0 < len(held) <= len(ids) and _common(held, ids) == len(held):
                    slots[r], cached[r], after = s, len(held), s + 1
                    used.add(s)
                    break
        for r, ids in enumerate(rows):  # the others: the free slot sharing most with it
            if slots[r] >= 0:
                continue
            free = [s for s in range(len(self.held)) if s not in used]
            if not free:
                continue
            best = max(free, key=lambda s: _common(self.held[s], ids))
            slots[r], cached[r] = best, _common(self.held[best], ids)
            used.add(best)
        cached = [min(c, len(ids) - 1) for c, ids in zip(cached, rows, strict=True)]
        return SlotAssignment(slots, cached)

    def keep(self, prefixes: Sequence[Sequence[int]], slots: Sequence[int], turns: list[Turn]):
        """Record what each slot holds after a call: its prefix and its turn but the last id."""
        for prefix, slot, turn in zip(prefixes, slots, turns, strict=True):
            if slot >= 0:
                ids = list(prefix) + turn.ids[: max(len(turn.ids) - 1, 0)]
                self.held[slot] = np.asarray(ids, dtype=np.int64)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def continuation_generate(
    sampler: Any, params: SamplingParams, decoding: Decoding, *, kv_cache: bool = True
) -> Generate:
    """``generate`` over ``sampler``, continuing each episode from its cache (see the
    module docstring); :func:`sampler_generate` (re-prefill) when
    ``kv_cache`` is False or the sampler has no ``start_session``. The n-th call is seeded
    ``decoding.seed + n`` either way. The session (and its cache) lives as long as the
    returned function: make one per round of episodes."""
    if not kv_cache or not callable(getattr(sampler, "start_session", None)):
        return sampler_generate(sampler, params, decoding)
    session: list[Continuation] = []
    table = SlotTable()
    calls = [0]

    def generate(prefixes: list[list[int]], max_new_tokens: int) -> list[Turn]:
        if not session:
            session.append(sampler.start_session(decoding))
        prefixes = [list(p) for p in prefixes]
        rows = table.assign(prefixes)
        call_params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
        seed = decoding.seed + calls[0]
        calls[0] += 1
        turns = Turn.each_of(session[0].generate(prefixes, call_params, seed, rows))
        table.keep(prefixes, rows.slots, turns)
        return turns

    return generate


def sampler_generate(sampler: Any, params: Any, decoding: Any) -> Generate:
    """``generate`` over a strop sampler's ``generate(prompts, params, **decoding)``: each
    call samples from the whole prefixes with ``params`` at the call's ``max_new_tokens``.
    The n-th call of one adapter has seed ``decoding.seed + n`` (the same seed, the same
    episodes; a row's turns do not reuse one draw where a sampler keys them by row)."""
    calls = [0]

    def generate(prefixes: list[list[int]], max_new_tokens: int) -> list[Turn]:
        call_params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
        call_decoding = dataclasses.replace(decoding, seed=decoding.seed + calls[0])
        calls[0] += 1
        prompts = [list(p) for p in prefixes]
        return Turn.each_of(sampler.generate(prompts, call_params, **call_decoding.keywords()))

    return generate
