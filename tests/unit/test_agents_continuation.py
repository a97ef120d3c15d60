"""strop.agents.continuation on the host: which cache slot each prefix continues, and how
much of it the slot holds (SlotTable); continuation_generate's seeds and its fallback to
re-prefill. The samplers themselves: tests/integration/test_agents_continuation.py."""

from __future__ import annotations

from dataclasses import astuple

import numpy as np

from strop.agents.continuation import SlotAssignment, SlotTable, continuation_generate
from strop.agents.rollout import Turn
from strop.generation import Decoding, Generation, SamplingParams


def turn(*ids: int) -> Turn:
    return Turn(list(ids), [0.0] * len(ids), "stop")


def test_each_running_episode_continues_from_its_own_slot() -> None:
    table = SlotTable()
    first = [[1, 2], [1, 2], [5, 6, 7]]  # two episodes of one prompt side by side
    slots, cached = astuple(table.assign(first))
    assert (slots, cached) == ([0, 1, 2], [0, 0, 0])
    table.keep(first, slots, [turn(3, 4), turn(8, 9), turn(4)])
    # each slot holds its prefix and its turn but the last token (never fed back)
    assert [h.tolist() for h in table.held] == [[1, 2, 3], [1, 2, 8], [5, 6, 7]]
    # episode 0 finished; the others went on with the environment's messages
    second = [[1, 2, 8, 9, 40, 41], [5, 6, 7, 4, 42]]
    slots, cached = astuple(table.assign(second))
    assert (slots, cached) == ([1, 2], [3, 3])
    table.keep(second, slots, [turn(10, 11), turn(12)])
    # a padding copy of the last row (a JAX batch bucket) takes a freed slot, sharing none
    third = [[5, 6, 7, 4, 42, 12, 43], [5, 6, 7, 4, 42, 12, 43]]
    slots, cached = astuple(table.assign(third))
    assert (slots, cached) == ([2, 0], [5, 0])


def test_a_slot_is_reused_only_for_the_ids_it_holds() -> None:
    table = SlotTable()
    prefixes = [[1, 2, 3], [7, 8]]
    slots, _ = astuple(table.assign(prefixes))
    table.keep(prefixes, slots, [turn(4, 5, 6), turn(9)])
    # a turn cut short (a stop string): the slot's ids are no longer a prefix of the row
    slots, cached = astuple(table.assign([[1, 2, 3, 4, 30], [7, 8, 9, 31]]))
    assert (slots, cached) == ([0, 1], [4, 2])
    # a prefix the slot holds entirely still feeds its last id
    table.held[0] = np.asarray([1, 2, 3])
    slots, cached = astuple(table.assign([[1, 2, 3]]))
    assert (slots, cached) == ([0], [2])
    # more rows than slots: new slots
    slots, cached = astuple(table.assign([[1], [2], [3]]))
    assert slots == [0, 1, 2] and len(table.held) == 3


class FakeSession:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def generate(self, prefixes, params, seed, rows):
        self.calls.append((seed, list(rows.slots), list(rows.cached), params.max_new_tokens))
        rows = len(prefixes)
        tokens = np.full((rows, 2), 7, dtype=np.int32)
        return Generation(
            tokens, np.zeros((rows, 2), np.float32), np.full(rows, 2), ["length"] * rows
        )


class FakeSampler:
    def __init__(self) -> None:
        self.sessions: list = []
        self.prefilled: list = []

    def start_session(self, decoding):
        self.sessions.append([])
        return FakeSession(self.sessions[-1])

    def generate(self, prompts, params, **keywords):
        self.prefilled.append((keywords["seed"], prompts))
        return FakeSession([]).generate(prompts, params, keywords["seed"], SlotAssignment([], []))


def test_continuation_generate_seeds_each_call_and_falls_back_to_re_prefill() -> None:
    sampler = FakeSampler()
    params, decoding = SamplingParams(max_new_tokens=8), Decoding(3, (2,), 0)
    generate = continuation_generate(sampler, params, decoding)
    assert generate([[1, 2]], 4)[0].ids == [7, 7]
    assert generate([[1, 2, 7, 7, 9]], 4)[0].ids == [7, 7]
    assert sampler.sessions == [[(3, [0], [0], 4), (4, [0], [3], 4)]] and not sampler.prefilled
    off = continuation_generate(sampler, params, decoding, kv_cache=False)
    off([[1, 2]], 4)
    off([[1, 2, 7]], 4)
    assert [seed for seed, _ in sampler.prefilled] == [3, 4] and len(sampler.sessions) == 1
    plain = Plain()  # a sampler without sessions (vLLM) re-prefills
    continuation_generate(plain, params, decoding)([[1]], 2)
    assert len(plain.prefilled) == 1


class Plain:
    generate = FakeSampler.generate

    def __init__(self) -> None:
        self.prefilled: list = []
