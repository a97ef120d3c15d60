"""Rollout rows packed end to end into fewer rows, so that forwards and updates skip padding.

A rollout batch has the run's width on JAX (the longest prompt plus
``generation.max_new_tokens``), but a row's real tokens fill about 60% of it on the demo;
torch trims the columns no row uses, which leaves most of that padding in place. Packing
moves each row's real tokens (one contiguous span between the left padding of the prompt
and the right padding of the response) end to end into *bins*, first-fit by decreasing
length, so that the forwards and backwards run over fewer rows. A bin is ``bin_width``
times as wide as the batch (``ppo.pack_width``): wider bins hold a prompt's rollouts
behind one copy of it (below), at the cost of attention over longer rows (on the demo, 2
saved about a quarter of the update's time over 1, and 3 less than 2). Rows never attend
across spans: ``attention_mask`` becomes segment ids (1, 2, ... per bin, 0 for padding)
and each span gets its own ``positions`` (0, 1, ... from its first token), which the
model reads as a block-diagonal causal mask. Every other ``[B, L]`` array moves with its
tokens, so the per-token convention (column ``t`` about ``x_t``, read from column
``t - 1``) holds inside each span: a span's first column is a prompt token, which never
has a loss weight.

**Shared prompts.** Rollouts sampled from the same prompt (``num_generations_per_prompt``)
repeat its tokens row after row. Given the rows' ``input_ids`` and ``response_mask``, the
packing lays such rows out as one *prefix* (the prompt but its last token) followed by
one segment per rollout (that last prompt token, then the response), and each segment
sees the prefix as if it stood before it: the prompt's forward and backward run once per
group instead of once per rollout, and every number is what the rows compute apart (the
prompt tokens never carry a loss weight, and each segment's first column is the last
prompt token, so column ``t - 1`` is still the right context for column ``t``). A group
that does not fit one bin is split, each part with its own copy of the prefix. In the
packed ``attention_mask`` a token holds ``segment + PREFIX_STRIDE * prefix``: its own
segment id and the id of the prefix segment it sees too (0: none); each backend's model
reads that as its attention mask.

For JAX the bin count comes from a few fixed *buckets* (fractions of the rows, see
:data:`BUCKETS`): the smallest that fits is used, else the batch runs as it is, so a run
compiles a few shapes per function whatever its responses (in practice two or three: each
costs a trace, some seconds on the demo). Eager torch runs any shape, so it takes the
fewest bins that first-fit fills (``buckets=False``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

BUCKETS = (1 / 2, 5 / 8, 3 / 4, 7 / 8)
"""Bin counts tried, as fractions of the batch's rows over the bins' relative width
(``bin_width``): the smallest that fits is used. Rows packed apart need about 3/4 of the
rows on the demo; with shared prompts, bins twice as wide and mini-batches of whole groups,
1/2 of half the rows (one group per bin)."""

FORWARD_COLUMNS = ("input_ids", "attention_mask", "response_mask")
"""What a forward over rollout rows reads to pack them (``response_mask``: to share prompts)."""

PREFIX_STRIDE = 1 << 16
"""A packed ``attention_mask`` is ``segment + PREFIX_STRIDE * prefix`` (see the module
docstring): a bin holds far fewer than this many segments."""


@dataclass(frozen=True)
class Packing:
    """Where each row's real tokens go: ``[rows, columns]`` arrays <-> ``[bins, width]``."""

    rows: int
    columns: int
    bins: int
    width: int
    source: np.ndarray  # flat indices into [rows, columns] of every real token
    target: np.ndarray  # their flat indices into [bins, width]
    segments: np.ndarray  # [bins, width] segment ids, 0 on padding
    positions: np.ndarray  # [bins, width] position of each token within its row
    prefixes: np.ndarray  # [bins, width] the segment id of the shared prompt seen too, or 0

    def pack(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every ``[rows, columns]`` array as ``[bins, width]``; ``attention_mask`` becomes
        the segment ids (``+ PREFIX_STRIDE *`` the prefix each token sees), and
        ``positions`` is added. A shared prompt's tokens take the values of one of its rows
        (the same tokens, and never a loss weight)."""
        packed = {}
        for name, array in arrays.items():
            if name == "attention_mask":
                packed[name] = self.segments + PREFIX_STRIDE * self.prefixes
                continue
            out = np.zeros(self.bins * self.width, array.dtype)
            out[self.target] = array.reshape(-1)[self.source]
            packed[name] = out.reshape(self.bins, self.width)
        packed["positions"] = self.positions.copy()
        return packed

    def unpack(self, packed: np.ndarray) -> np.ndarray:
        """A ``[bins, width]`` per-token output back as ``[rows, columns]`` (0 on padding)."""
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


def shared_prompts(batch: Mapping[str, np.ndarray], share: bool) -> dict[str, np.ndarray]:
    """:func:`plan`'s keywords that let rows share their prompt (``ppo.share_prompts``):
    the batch's ``input_ids`` and ``response_mask``, when it has both."""
    if not share or "response_mask" not in batch:
        return {}
    return {"input_ids": batch["input_ids"], "response_mask": batch["response_mask"]}


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


def plan(
    attention_mask: np.ndarray,
    multiple: int = 1,
    *,
    buckets: bool = True,
    bin_width: float = 1.0,
    input_ids: np.ndarray | None = None,
    response_mask: np.ndarray | None = None,
) -> Packing | None:
    """The packing of a ``[B, L]`` batch into bins ``ceil(bin_width * L)`` wide, with the
    smallest bin count that holds it: among the buckets of :func:`bin_counts` (``buckets``,
    for backends that compile per shape; ``B / bin_width`` rows' worth), else among
    :func:`fewest_bin_counts`. With ``input_ids`` and
    ``response_mask``, rows with the same prompt share its tokens (the module docstring).
    ``None`` (the batch runs as it is) when no count with fewer bins than rows holds it,
    or a row's real tokens are not one contiguous span."""
    mask = np.asarray(attention_mask) > 0
    rows, columns = mask.shape
    width = math.ceil(bin_width * columns)
    real = mask.sum(axis=1)
    starts = np.where(real > 0, mask.argmax(axis=1), 0)
    ends = np.where(real > 0, columns - mask[:, ::-1].argmax(axis=1), 0)
    if np.any(ends - starts != real):
        return None
    if input_ids is None or response_mask is None:
        units = [_Unit(None, 0, ((row, 0, int(real[row])),)) for row in range(rows) if real[row]]
    else:
        units = _units(np.asarray(input_ids), np.asarray(response_mask) > 0, starts, real, width)
    lengths = [unit.length for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-lengths[u], u))  # first-fit decreasing
    counts = (
        bin_counts(math.ceil(rows / bin_width), multiple)
        if buckets
        else fewest_bin_counts(rows, int(sum(lengths)), width, multiple)
    )
    for bins in counts:
        if bins >= rows:
            return None
        placed = _first_fit(order, lengths, width, bins)
        if placed is not None:
            return _packing(mask.shape, starts, units, placed, bins, width)
    return None


@dataclass(frozen=True)
class _Unit:
    """What goes into a bin in one piece: a shared prompt's first ``prefix`` tokens (as
    row ``prefix_row`` has them; ``None``: no shared prompt), then one segment per member
    ``(row, first token after the prefix, tokens)``."""

    prefix_row: int | None
    prefix: int
    members: tuple[tuple[int, int, int], ...]

    @property
    def length(self) -> int:
        return self.prefix + sum(n for _, _, n in self.members)


def _units(
    input_ids: np.ndarray, response: np.ndarray, starts: np.ndarray, real: np.ndarray, width: int
) -> list[_Unit]:
    """Rows grouped by their prompt tokens (the real tokens before the response); a group
    of two or more rows shares all but the last prompt token, in as few units as fit."""
    groups: dict[bytes, list[int]] = {}
    prompt = {}
    for row in range(len(real)):
        if not real[row]:
            continue
        start = int(starts[row])
        after = response[row, start : start + int(real[row])]
        prompt[row] = int(after.argmax()) if after.any() else int(real[row])
        key = input_ids[row, start : start + prompt[row]].tobytes()
        groups.setdefault(key, []).append(row)
    units = []
    for members in groups.values():
        shared = prompt[members[0]] - 1
        if len(members) < 2 or shared < 1:
            units += [_Unit(None, 0, ((row, 0, int(real[row])),)) for row in members]
            continue
        segments = [(row, shared, int(real[row]) - shared) for row in members]
        segments.sort(key=lambda segment: -segment[2])
        parts: list[list[tuple[int, int, int]]] = []
        for segment in segments:  # first-fit decreasing into what a bin leaves the prefix
            for part in parts:
                if sum(n for _, _, n in part) + segment[2] <= width - shared:
                    part.append(segment)
                    break
            else:
                parts.append([segment])
        units += [_Unit(part[0][0], shared, tuple(part)) for part in parts]
    return units


def _first_fit(order, lengths, width: int, bins: int) -> dict[int, tuple[int, int]] | None:
    """``unit -> (bin, offset)`` for every unit, or ``None`` if ``bins`` bins are not
    enough."""
    used = [0] * bins
    placed = {}
    for unit in order:
        n = int(lengths[unit])
        for b in range(bins):
            if used[b] + n <= width:
                placed[unit] = (b, used[b])
                used[b] += n
                break
        else:
            return None
    return placed


def _packing(shape, starts, units: list[_Unit], placed, bins: int, width: int) -> Packing:
    rows, columns = shape
    segments = np.zeros((bins, width), np.int32)
    positions = np.zeros((bins, width), np.int32)
    prefixes = np.zeros((bins, width), np.int32)
    source, target = [], []
    next_segment = [1] * bins

    def put(row: int, first: int, n: int, b: int, offset: int, position: int, seen: int) -> None:
        source.append(row * columns + int(starts[row]) + first + np.arange(n))
        target.append(b * width + offset + np.arange(n))
        segments[b, offset : offset + n] = next_segment[b]
        positions[b, offset : offset + n] = position + np.arange(n)
        prefixes[b, offset : offset + n] = seen
        next_segment[b] += 1

    for index, (b, offset) in sorted(placed.items(), key=lambda item: item[1]):
        unit = units[index]
        seen = 0
        if unit.prefix_row is not None:
            seen = next_segment[b]
            # every member's prompt maps onto the one copy: packing writes one row's tokens
            # there (they are the same), unpacking gives each row its outputs back
            for row, _, _ in unit.members:
                source.append(row * columns + int(starts[row]) + np.arange(unit.prefix))
                target.append(b * width + offset + np.arange(unit.prefix))
            segments[b, offset : offset + unit.prefix] = seen
            positions[b, offset : offset + unit.prefix] = np.arange(unit.prefix)
            next_segment[b] += 1
            offset += unit.prefix
        for row, first, n in unit.members:
            put(row, first, n, b, offset, unit.prefix, seen)
            offset += n
    empty = np.zeros(0, np.int64)
    return Packing(
        rows=rows, columns=columns, bins=bins, width=width,
        source=np.concatenate(source) if source else empty,
        target=np.concatenate(target) if target else empty,
        segments=segments, positions=positions, prefixes=prefixes,
    )  # fmt: skip
