"""Packing rollout rows into bins (strop.batch.packing): every real token moves, with its own
segment id and position, and comes back where it was."""

from __future__ import annotations

import numpy as np
import pytest

from strop.batch import packing


def _batch(spans: list[tuple[int, int]], columns: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows whose real tokens are ``[start, start + length)``; token ids and a float
    array that say which row and column each came from."""
    rows = len(spans)
    mask = np.zeros((rows, columns), np.int32)
    for row, (start, length) in enumerate(spans):
        mask[row, start : start + length] = 1
    ids = (np.arange(rows)[:, None] * 1000 + np.arange(columns)[None, :] + 1) * mask
    values = np.random.default_rng(seed).normal(size=(rows, columns)).astype(np.float32) * mask
    return {"input_ids": ids, "attention_mask": mask, "advantages": values}


def test_every_real_token_is_packed_once_and_unpacked_where_it_was():
    spans = [(10, 30), (0, 40), (25, 15), (5, 35), (38, 2), (0, 0), (12, 28), (20, 20)]
    batch = _batch(spans, 40)
    plan = packing.plan(batch["attention_mask"])
    assert plan is not None and plan.columns == 40 and plan.bins == 5  # five eighths of 8
    packed = plan.pack(batch)
    assert packed["input_ids"].shape == (plan.bins, 40)
    # all the tokens and nothing else
    assert sorted(packed["input_ids"][packed["input_ids"] > 0]) == sorted(
        batch["input_ids"][batch["input_ids"] > 0]
    )
    for name in ("input_ids", "advantages"):
        np.testing.assert_array_equal(plan.unpack(packed[name]), batch[name])
    # each row is one segment of its bin: consecutive columns, positions 0..n-1, in order
    for b in range(plan.bins):
        segments = packed["attention_mask"][b]
        for segment in set(segments[segments > 0].tolist()):
            columns = np.flatnonzero(segments == segment)
            assert np.all(np.diff(columns) == 1)
            np.testing.assert_array_equal(packed["positions"][b, columns], np.arange(len(columns)))
            ids = packed["input_ids"][b, columns]
            assert len(set((ids - 1) // 1000)) == 1  # one source row
            assert np.all(np.diff(ids) == 1)  # its columns in order


def test_the_smallest_bucket_that_fits_is_used():
    short = _batch([(0, 10)] * 16, 40)["attention_mask"]  # 8 rows' worth of tokens per bin
    assert packing.plan(short).bins == 8  # half of 16 rows, the smallest bucket
    rng = np.random.default_rng(1)
    for _ in range(50):
        lengths = rng.integers(1, 25, size=12)
        starts = [int(rng.integers(0, 41 - n)) for n in lengths]
        mask = _batch(list(zip(starts, lengths, strict=True)), 40)["attention_mask"]
        plan = packing.plan(mask, multiple=2)
        assert plan.bins in packing.bin_counts(12, 2) and plan.bins % 2 == 0
        assert plan.bins < 12
        smaller = [n for n in packing.bin_counts(12, 2) if n < plan.bins]
        order = sorted(range(12), key=lambda r: -lengths[r])
        assert all(packing._first_fit(order, lengths, 40, n) is None for n in smaller)


def test_a_batch_no_bucket_holds_runs_as_it_is():
    assert packing.plan(np.ones((16, 40), np.int32)) is None  # no padding to save
    nearly_full = _batch([(0, 40)] * 14 + [(20, 20)] * 2, 40)["attention_mask"]
    assert packing.plan(nearly_full) is None  # 15 bins: more than seven eighths
    half = _batch([(10, 20)] * 8, 40)["attention_mask"]
    assert packing.plan(half).bins == 4  # half the rows, the smallest bucket
    assert packing.plan(half, multiple=8) is None  # 8 bins: as many as rows


def test_without_buckets_the_fewest_bins_that_first_fit_fills_are_used():
    half = _batch([(10, 20)] * 8, 40)["attention_mask"]
    assert packing.plan(half, buckets=False).bins == 4  # two rows per bin
    assert packing.plan(half, multiple=3, buckets=False).bins == 6  # 4 rounded up to 3s
    assert packing.plan(half, multiple=4, buckets=False).bins == 4
    # 150 tokens are 4 bins' worth, but first-fit cannot place them in 4 (no two 30s, nor a
    # 30 and a 20, share a bin of 40): 5
    awkward = _batch([(0, 30)] * 3 + [(0, 20)] * 3, 40)["attention_mask"]
    assert packing.fewest_bin_counts(6, 150, 40)[0] == 4
    assert packing.plan(awkward, buckets=False).bins == 5
    assert packing.plan(np.ones((16, 40), np.int32), buckets=False) is None
    rng = np.random.default_rng(2)
    for _ in range(50):
        lengths = rng.integers(1, 41, size=16)
        mask = _batch([(0, int(n)) for n in lengths], 40)["attention_mask"]
        plan = packing.plan(mask, multiple=2, buckets=False)
        if plan is None:
            continue
        assert plan.bins % 2 == 0 and plan.bins < 16
        order = sorted(range(16), key=lambda r: -lengths[r])
        assert packing._first_fit(order, lengths, 40, plan.bins - 2) is None


def test_bin_counts_are_multiples_for_micro_batches_and_devices():
    assert packing.bin_counts(32) == (16, 20, 24, 28)
    assert packing.bin_counts(32, multiple=8) == (16, 24, 32)
    assert packing.bin_counts(8, multiple=4) == (4, 8)


def test_a_row_with_a_hole_is_not_packed():
    mask = np.ones((4, 8), np.int32)
    mask[2, 3] = 0
    assert packing.plan(mask) is None


@pytest.mark.parametrize("columns", [1, 7])
def test_one_row_is_left_as_it_is(columns):
    assert packing.plan(_batch([(0, columns)], columns)["attention_mask"]) is None


def _groups(prompts: list[int], responses: list[int], copies: int, columns: int):
    """``copies`` rollouts of each prompt (``prompts[g]`` tokens, left-padded to the widest)
    with ``responses[g * copies + i]`` response tokens each, right-padded to ``columns``."""
    width = max(prompts)
    rows = len(prompts) * copies
    ids = np.zeros((rows, columns), np.int64)
    mask = np.zeros((rows, columns), np.int32)
    response = np.zeros((rows, columns), np.float32)
    for row in range(rows):
        group, n = row // copies, responses[row]
        p = prompts[group]
        ids[row, width - p : width] = 100 * (group + 1) + np.arange(p)  # the group's prompt
        ids[row, width : width + n] = 10_000 * (row + 1) + np.arange(n)  # its own response
        mask[row, width - p : width + n] = 1
        response[row, width : width + n] = 1
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response}


def test_rollouts_of_one_prompt_share_it_and_see_it_as_their_own():
    batch = _groups([9, 6, 12], [5, 3, 7, 2, 4, 4, 8, 1, 6], copies=3, columns=24)
    plain = packing.plan(batch["attention_mask"], buckets=False)
    plan = packing.plan(batch["attention_mask"], buckets=False, input_ids=batch["input_ids"],
                        response_mask=batch["response_mask"])  # fmt: skip
    assert plan.bins < plain.bins  # the prompts' tokens are packed once per group, not thrice
    packed = plan.pack(batch)
    for name in ("input_ids", "response_mask"):  # every row gets its own tokens back
        np.testing.assert_array_equal(plan.unpack(packed[name]), batch[name])
    mask = packed["attention_mask"]
    own, seen = mask % packing.PREFIX_STRIDE, mask // packing.PREFIX_STRIDE
    np.testing.assert_array_equal(own, plan.segments)
    np.testing.assert_array_equal(seen, plan.prefixes)
    # each row's context, read off the packed layout as the model does (its own segment and
    # the prefix it sees, before it), is the row's own tokens in order, at its positions
    for row in range(len(batch["input_ids"])):
        tokens = batch["input_ids"][row][batch["attention_mask"][row] > 0]
        last = plan.target[
            plan.source == row * 24 + np.flatnonzero(batch["attention_mask"][row])[-1]
        ]
        b, column = divmod(int(last[0]), 24)
        visible = [c for c in range(column + 1)
                   if own[b, c] and (own[b, c] == own[b, column] or own[b, c] == seen[b, column])]  # fmt: skip
        np.testing.assert_array_equal(packed["input_ids"][b, visible], tokens)
        np.testing.assert_array_equal(packed["positions"][b, visible], np.arange(len(tokens)))
    assert (seen > 0).any() and not (seen[own == 0] > 0).any()
    # a shared prompt's last token opens every segment, so no weighted token is shared
    shared = np.bincount(plan.target, minlength=plan.bins * 24) > 1  # columns of several rows
    assert shared.any() and not packed["response_mask"].reshape(-1)[shared].any()


def test_a_group_too_long_for_one_bin_is_split_with_a_prefix_copy_each():
    batch = _groups([10], [8, 8, 8, 8], copies=4, columns=20)
    plan = packing.plan(batch["attention_mask"], buckets=False, input_ids=batch["input_ids"],
                        response_mask=batch["response_mask"])  # fmt: skip
    # 9 prefix tokens + segments of 9: one per bin fits (18), two do not (27)
    assert plan is None  # as many bins as rows: nothing to save, the batch runs as it is
    batch = _groups([10], [3, 3, 3, 3], copies=4, columns=20)
    plan = packing.plan(batch["attention_mask"], buckets=False, input_ids=batch["input_ids"],
                        response_mask=batch["response_mask"])  # fmt: skip
    assert plan.bins == 2  # 9 + 2 x 4 = 17 columns each: two rollouts per copy of the prompt
    assert [int((plan.prefixes[b] > 0).sum()) for b in range(2)] == [8, 8]  # 2 segments each
    np.testing.assert_array_equal(plan.unpack(plan.pack(batch)["input_ids"]), batch["input_ids"])


def test_rows_whose_prompts_differ_are_not_shared():
    batch = _groups([5, 5], [3, 3], copies=1, columns=16)
    plan = packing.plan(batch["attention_mask"], buckets=False, input_ids=batch["input_ids"],
                        response_mask=batch["response_mask"])  # fmt: skip
    assert not plan.prefixes.any()


def test_bins_twice_as_wide_hold_a_whole_group_behind_one_prompt_copy():
    batch = _groups([10], [8, 8, 8, 8], copies=4, columns=20)  # too long for one 20-wide bin
    shared = {"input_ids": batch["input_ids"], "response_mask": batch["response_mask"]}
    plan = packing.plan(batch["attention_mask"], buckets=False, bin_width=2, **shared)
    # 9 prefix tokens + 4 segments of 9 = 45 > 40: two bins, the prompt copied twice
    assert plan.width == 40 and plan.bins == 2
    plan = packing.plan(batch["attention_mask"], buckets=False, bin_width=2.5, **shared)
    assert plan.width == 50 and plan.bins == 1  # 45 <= 50: one copy of the prompt
    packed = plan.pack(batch)
    assert packed["input_ids"].shape == (1, 50) and packed["positions"].shape == (1, 50)
    assert int((packed["attention_mask"] > 0).sum()) == 45
    for name in ("input_ids", "response_mask"):
        np.testing.assert_array_equal(plan.unpack(packed[name]), batch[name])


def test_wide_bins_count_buckets_over_the_rows_they_stand_for():
    short = _batch([(0, 10)] * 16, 40)["attention_mask"]  # 4 rows' worth per 40 columns
    plan = packing.plan(short, bin_width=2)  # bins 80 wide: 8 rows' worth each
    assert plan.width == 80 and plan.bins == 4  # half of the 8 rows 16 stand for at 2x
    assert plan.bins in packing.bin_counts(8)
    np.testing.assert_array_equal(plan.unpack(plan.pack({"m": short})["m"]), short)
