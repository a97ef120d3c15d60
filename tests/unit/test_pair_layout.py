"""The pair layout (strop.batch.pairs): every masked token is its answer's, and sees exactly
its prompt and the answer before it, at the right positions; the prompt is laid out once per
pair; the per-pair sums and the loss over the layout are those of the pairs apart, also split
into micro-batches."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

from strop.batch.packing import PREFIX_STRIDE
from strop.batch.pairs import PAIR_COLUMNS, lay_out_pairs
from strop.objectives.preference import PreferenceObjective, preference_loss, preference_micro_loss
from tests.losses_reference import NUMPY_OPS


def random_pairs(seed: int, count: int = 6, shared: int = 2):
    """``count`` pairs with prompts of 1 to 9 tokens; ``shared`` of them reuse the first's
    prompt (its answers differ)."""
    rng = np.random.default_rng(seed)

    def ids(low, high):
        return [int(t) for t in rng.integers(3, 50, int(rng.integers(low, high)))]

    pairs = []
    for index in range(count):
        prompt = list(pairs[0][0]) if 0 < index <= shared else ids(1, 10)
        pairs.append((prompt, ids(1, 8), ids(1, 8)))
    pairs[-1] = ([7], pairs[-1][1], pairs[-1][2])  # a one-token prompt
    return pairs


def seen_from(layout, row: int, column: int) -> list[int]:
    """The columns the query at ``(row, column)`` attends to, as both backends read a packed
    ``attention_mask`` (its own segment and the prefix it names, causally)."""
    packed = layout["attention_mask"][row]
    segments, prefixes = packed % PREFIX_STRIDE, packed // PREFIX_STRIDE
    own, prefix = segments[column], prefixes[column]
    return [
        i
        for i in range(column + 1)
        if segments[i] > 0 and (segments[i] == own or (prefix and segments[i] == prefix))
    ]


def check_layout(layout, pairs) -> None:
    assert set(layout) == set(PAIR_COLUMNS)
    assert not (layout["chosen_masks"] * layout["rejected_masks"]).any()
    both = layout["chosen_masks"].sum(0) + layout["rejected_masks"].sum(0)
    np.testing.assert_array_equal(both, layout["answer_mask"])
    for p, (prompt, chosen, rejected) in enumerate(pairs):
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            cells = np.argwhere(layout[f"{name}_masks"][p] > 0)  # row-major: the answer's order
            assert layout[f"{name}_tokens"][p] == len(answer) == len(cells)
            assert len(set(cells[:, 0])) == 1, "an answer is split over rows"
            for k, (row, column) in enumerate(cells):
                assert layout["input_ids"][row, column] == answer[k]
                seen = seen_from(layout, row, column - 1)  # the logits that predict it
                assert [layout["input_ids"][row, i] for i in seen] == prompt + answer[:k]
                assert layout["positions"][row, seen].tolist() == list(range(len(seen)))
                assert layout["positions"][row, column] == len(prompt) + k


@pytest.mark.parametrize("seed", range(4))
def test_masks_select_each_answer_which_sees_its_prompt_and_not_the_other_answer(seed):
    pairs = random_pairs(seed)
    layout = lay_out_pairs(pairs)
    check_layout(layout, pairs)
    rows, width = layout["input_ids"].shape
    assert rows < 2 * len(pairs) and width == 2 * max(
        len(p) + max(len(c), len(r)) for p, c, r in pairs
    )
    # the prompt but its last token at most once per pair (a group of pairs with the same
    # prompt may share one copy); exactly once for distinct prompts
    once = sum(len(p) - (len(p) > 1) + len(c) + len(r) + 2 - (len(p) == 1) for p, c, r in pairs)
    real = int((layout["attention_mask"] > 0).sum())
    assert real <= once
    distinct = random_pairs(seed, shared=0)
    assert int((lay_out_pairs(distinct)["attention_mask"] > 0).sum()) == sum(
        len(p) - 1 + len(c) + len(r) + 2 if len(p) > 1 else len(c) + len(r) + 2
        for p, c, r in distinct
    )
    np.testing.assert_allclose(layout["pair_weights"], 1 / len(pairs))


def test_unshared_rows_bucketed_bins_and_fixed_columns_keep_the_masks_right():
    pairs = random_pairs(9)
    unshared = lay_out_pairs(pairs, share=False, columns=24, batch_pairs=12)
    check_layout(unshared, pairs)
    assert unshared["input_ids"].shape == (2 * len(pairs), 24)
    np.testing.assert_allclose(unshared["pair_weights"], 1 / 12)
    bucketed = lay_out_pairs(pairs, buckets=True, multiple=2, columns=24)
    check_layout(bucketed, pairs)
    assert bucketed["input_ids"].shape[0] % 2 == 0 and bucketed["input_ids"].shape[1] == 48
    with pytest.raises(ValueError, match="more than 5 columns"):
        lay_out_pairs(pairs, columns=5)
    with pytest.raises(ValueError, match="empty prompt or answer"):
        lay_out_pairs([([1, 2], [], [3])])


def toy_logprob(context: list[int], token: int) -> float:
    """A deterministic stand-in for a model: the log-probability of ``token`` after
    ``context`` (a different value for any other context)."""
    key = zlib.crc32(np.asarray([*context, -1, token], np.int64).tobytes())
    return -0.05 - (key % 10_000) / 2_000.0


def toy_forward(layout) -> np.ndarray:
    """``[R, W]`` per-token log-probabilities over the layout (column ``t``: of ``x_t`` from
    what column ``t - 1`` sees), NaN where no answer token is."""
    out = np.full(layout["input_ids"].shape, np.nan)
    for row, column in np.argwhere(layout["answer_mask"] > 0):
        context = [int(layout["input_ids"][row, i]) for i in seen_from(layout, row, column - 1)]
        out[row, column] = toy_logprob(context, int(layout["input_ids"][row, column]))
    return out


def apart(pairs) -> dict[str, np.ndarray]:
    """The pairs' sums and counts computed one answer at a time, with no layout."""
    out = {f"{n}_{k}": [] for n in ("chosen", "rejected") for k in ("logps", "tokens")}
    for prompt, chosen, rejected in pairs:
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            total = sum(toy_logprob(prompt + answer[:k], answer[k]) for k in range(len(answer)))
            out[f"{name}_logps"].append(total)
            out[f"{name}_tokens"].append(len(answer))
    return {name: np.asarray(values, np.float64) for name, values in out.items()}


def test_the_loss_over_the_layout_is_the_pairs_loss_apart_also_in_micro_batches():
    pairs = random_pairs(3, count=7)
    direct = apart(pairs)
    reference = {
        "ref_chosen_logps": direct["chosen_logps"] + np.linspace(-3, 2, 7),
        "ref_rejected_logps": direct["rejected_logps"] + np.linspace(1, -2, 7),
    }
    objective = PreferenceObjective("sigmoid", 0.3, 0.1)
    want_loss, want = preference_loss(
        NUMPY_OPS, {**direct, **reference}, np.full(7, 1 / 7), objective
    )
    # the layout's "logits" are the toy forward's per-token log-probabilities
    ops = dataclasses.replace(NUMPY_OPS, token_logprobs=lambda logits, ids, t: logits)
    total, stats = 0.0, {}
    for part in (slice(0, 3), slice(3, 7)):
        layout = lay_out_pairs(pairs[part], batch_pairs=7)
        micro = {**layout, **{name: value[part] for name, value in reference.items()}}
        loss, part_stats = preference_micro_loss(ops, toy_forward(layout), micro, objective)
        total += loss
        for name, value in part_stats.items():
            stats[name] = stats.get(name, 0.0) + value
    # (the layout's pair weights are float32, as every loss weight)
    assert total == pytest.approx(want_loss, rel=1e-6)
    for name, value in want.items():
        assert stats[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
