"""Packing rollout rows into bins (strop.rl.packing): every real token moves, with its own
segment id and position, and comes back where it was."""

from __future__ import annotations

import numpy as np
import pytest

from strop.rl import packing


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
    assert plan is not None and plan.columns == 40 and plan.bins == 6
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
    assert packing.plan(short).bins == 12  # six eighths of 16 rows
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
    assert packing.plan(half).bins == 6  # fits in 4: the smallest bucket is 6
    assert packing.plan(half, multiple=4) is None  # 8 bins: as many as rows


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
    assert packing.bin_counts(32) == (24, 28)
    assert packing.bin_counts(32, multiple=8) == (24, 32)
    assert packing.bin_counts(8, multiple=4) == (8,)


def test_a_row_with_a_hole_is_not_packed():
    mask = np.ones((4, 8), np.int32)
    mask[2, 3] = 0
    assert packing.plan(mask) is None


@pytest.mark.parametrize("columns", [1, 7])
def test_one_row_is_left_as_it_is(columns):
    assert packing.plan(_batch([(0, columns)], columns)["attention_mask"]) is None
