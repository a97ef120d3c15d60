"""Rollout rows packed end to end into fewer rows, so that forwards and updates skip padding.

A rollout batch has the run's width on JAX (the longest prompt plus
``generation.max_new_tokens``), but a row's real tokens fill about 60% of it on the demo;
torch trims the columns no row uses, which leaves most of that padding in place. Packing
moves each row's real tokens (one contiguous span between the left padding of the prompt
and the right padding of the response) end to end into *bins* of the same width,
first-fit by decreasing length, so that the forwards and backwards run over fewer rows.
(Bins twice as wide hold the rows in fewer columns still, but attention over them costs
four times as much per bin: on the demo they saved half as much.) Rows never attend
across spans: ``attention_mask`` becomes segment ids (1, 2, ... per bin, 0 for padding)
and each span gets its own ``positions`` (0, 1, ... from its first token), which the
model reads as a block-diagonal causal mask. Every other ``[B, L]`` array moves with its
tokens, so the per-token convention (column ``t`` about ``x_t``, read from column
``t - 1``) holds inside each span: a span's first column is a prompt token, which never
has a loss weight.

For JAX the bin count comes from two fixed *buckets* (six and seven eighths of the rows):
the smallest that fits is used, else the batch runs as it is, so a run compiles at most
three shapes per function whatever its responses (each new one costs a trace, some
seconds on the demo, so more buckets did not pay). Eager torch runs any shape, so it
takes the fewest bins that first-fit fills (``buckets=False``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

BUCKETS = (3 / 4, 7 / 8)
"""Bin counts tried, as fractions of the batch's rows: the smallest that fits is used."""


@dataclass(frozen=True)
class Packing:
    """Where each row's real tokens go: ``[rows, columns]`` arrays <-> ``[bins, columns]``."""

    rows: int
    columns: int
    bins: int
    source: np.ndarray  # flat indices into [rows, columns] of every real token
    target: np.ndarray  # their flat indices into [bins, columns]
    segments: np.ndarray  # [bins, columns] segment ids, 0 on padding
    positions: np.ndarray  # [bins, columns] position of each token within its row

    def pack(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every ``[rows, columns]`` array as ``[bins, columns]``; ``attention_mask`` becomes
        the segment ids, and ``positions`` is added."""
        packed = {}
        for name, array in arrays.items():
            if name == "attention_mask":
                packed[name] = self.segments.copy()
                continue
            out = np.zeros(self.bins * self.columns, array.dtype)
            out[self.target] = array.reshape(-1)[self.source]
            packed[name] = out.reshape(self.bins, self.columns)
        packed["positions"] = self.positions.copy()
        return packed

    def unpack(self, packed: np.ndarray) -> np.ndarray:
        """A ``[bins, columns]`` per-token output back as ``[rows, columns]`` (0 on padding)."""
        out = np.zeros(self.rows * self.columns, packed.dtype)
        out[self.source] = packed.reshape(-1)[self.target]
        return out.reshape(self.rows, self.columns)


def packed(
    batch: Mapping[str, np.ndarray], names: Sequence[str], plan: Packing | None
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """An update's ``names`` arrays of ``batch`` packed by ``plan``, and the names its
    micro-batches read (``positions`` added); without a plan, the batch as it is."""
    if plan is None:
        return dict(batch), tuple(names)
    return plan.pack({name: batch[name] for name in names}), (*names, "positions")


def bin_counts(rows: int, multiple: int = 1) -> tuple[int, ...]:
    """The bucketed bin counts for ``rows`` rows, each a multiple of ``multiple`` (so that
    bins split into micro-batches and over devices evenly), smallest first."""
    counts = {
        max(multiple, -(-int(np.ceil(rows * share)) // multiple) * multiple) for share in BUCKETS
    }
    return tuple(sorted(counts))


def fewest_bin_counts(rows: int, tokens: int, columns: int, multiple: int = 1) -> range:
    """Every bin count below ``rows`` that could hold ``tokens`` tokens in bins ``columns``
    wide, each a multiple of ``multiple``, smallest first: for backends that run any
    shape (eager torch), where the fewest bins that fit are the cheapest."""
    least = max(1, -(-tokens // columns))
    first = max(multiple, -(-least // multiple) * multiple)
    return range(first, rows, multiple)


def plan(attention_mask: np.ndarray, multiple: int = 1, *, buckets: bool = True) -> Packing | None:
    """The packing of a ``[B, L]`` batch into bins ``L`` wide, with the smallest bin count
    that holds it: among the buckets of :func:`bin_counts` (``buckets``, for backends that
    compile per shape), else among :func:`fewest_bin_counts`. ``None`` (the batch runs as
    it is) when no count with fewer bins than rows holds it, or a row's real tokens are
    not one contiguous span."""
    mask = np.asarray(attention_mask) > 0
    rows, columns = mask.shape
    real = mask.sum(axis=1)
    starts = np.where(real > 0, mask.argmax(axis=1), 0)
    ends = np.where(real > 0, columns - mask[:, ::-1].argmax(axis=1), 0)
    if np.any(ends - starts != real):
        return None
    order = sorted(range(rows), key=lambda r: (-int(real[r]), r))  # first-fit decreasing
    counts = (
        bin_counts(rows, multiple)
        if buckets
        else fewest_bin_counts(rows, int(real.sum()), columns, multiple)
    )
    for bins in counts:
        if bins >= rows:
            return None
        placed = _first_fit(order, real, columns, bins)
        if placed is not None:
            return _packing(mask.shape, starts, real, placed, bins)
    return None


def _first_fit(order, lengths, width: int, bins: int) -> dict[int, tuple[int, int]] | None:
    """``row -> (bin, offset)`` for every row with tokens, or ``None`` if ``bins`` bins
    are not enough."""
    used = [0] * bins
    placed = {}
    for row in order:
        n = int(lengths[row])
        if n == 0:
            continue
        for b in range(bins):
            if used[b] + n <= width:
                placed[row] = (b, used[b])
                used[b] += n
                break
        else:
            return None
    return placed


def _packing(shape, starts, lengths, placed, bins: int) -> Packing:
    rows, columns = shape
    segments = np.zeros((bins, columns), np.int32)
    positions = np.zeros((bins, columns), np.int32)
    source, target = [], []
    next_segment = [1] * bins
    for row, (b, offset) in sorted(placed.items(), key=lambda item: item[1]):
        n = int(lengths[row])
        source.append(row * columns + int(starts[row]) + np.arange(n))
        target.append(b * columns + offset + np.arange(n))
        segments[b, offset : offset + n] = next_segment[b]
        positions[b, offset : offset + n] = np.arange(n)
        next_segment[b] += 1
    empty = np.zeros(0, np.int64)
    return Packing(
        rows=rows, columns=columns, bins=bins,
        source=np.concatenate(source) if source else empty,
        target=np.concatenate(target) if target else empty,
        segments=segments, positions=positions,
    )  # fmt: skip
