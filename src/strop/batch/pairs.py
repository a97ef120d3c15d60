"""Preference pairs laid out for one forward: a batch of ``(prompt, chosen, rejected)`` token
ids as rows a backend runs once, and the masks that give each answer's log-probability sum.

Each pair is first two rows, ``prompt + chosen`` and ``prompt + rejected``, right-padded to
``columns``; PPO's shared-prompt packing (:mod:`strop.batch.packing`, the rows'
``response_mask`` the answer tokens) then lays them out as the prompt but its last token
once, followed by one segment per answer (that last prompt token, then the answer), each
seeing the prompt and not the other answer: ``attention_mask`` holds ``segment +
PREFIX_STRIDE * prefix`` and ``positions`` each token's position in its own row, which both
backends' models read already. The prompt's forward and backward run once per pair (once
per group of pairs with the same prompt), and every number is what the two rows give
apart. When packing finds no layout with fewer rows (it always does for whole pairs, which
fit a bin twice as wide), or with ``share=False``, the rows stay as they are, one segment
each.

Per-token arrays follow the teacher-forcing convention (column ``t`` is about ``x_t``, read
from the logits at column ``t - 1``): ``answer_mask [R, W]`` is 1 on every answer token and
``chosen_masks`` / ``rejected_masks [P, R, W]`` select pair ``p``'s answer tokens, so that
``(chosen_masks * token_logprobs).sum((1, 2))`` is each chosen answer's log-probability
sum (:func:`strop.objectives.preference.pair_logps`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strop.batch import packing

Pair = tuple[Sequence[int], Sequence[int], Sequence[int]]
"""A pair's token ids: the prompt's, the chosen answer's, the rejected answer's."""

PAIR_COLUMNS = (
    "input_ids",
    "attention_mask",
    "positions",
    "answer_mask",
    "chosen_masks",
    "rejected_masks",
    "chosen_tokens",
    "rejected_tokens",
    "pair_weights",
)
"""The arrays :func:`lay_out_pairs` gives (the first four ``[R, W]``, the masks
``[P, R, W]``, the rest ``[P]``)."""


def pair_rows(
    pairs: Sequence[Pair], columns: int | None = None, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """The pairs unpacked: rows ``2p`` (prompt + chosen) and ``2p + 1`` (prompt +
    rejected), right-padded to ``columns`` (the longest row if None): ``input_ids``,
    ``attention_mask`` (0/1), ``response_mask`` (the answer tokens) and ``owner`` (``2p +
    1`` on pair ``p``'s chosen tokens, ``2p + 2`` on its rejected ones, else 0)."""
    rows = [
        (list(prompt), list(answer)) for prompt, chosen, rejected in pairs
        for answer in (chosen, rejected)
    ]  # fmt: skip
    if not rows:
        raise ValueError("no pairs to lay out")
    longest = max(len(prompt) + len(answer) for prompt, answer in rows)
    columns = longest if columns is None else columns
    if longest > columns:
        raise ValueError(f"a pair's row has {longest} tokens, more than {columns} columns")
    shape = (len(rows), columns)
    out = {
        "input_ids": np.full(shape, pad_id, np.int32),
        "attention_mask": np.zeros(shape, np.int32),
        "response_mask": np.zeros(shape, np.int32),
        "owner": np.zeros(shape, np.int32),
    }
    for row, (prompt, answer) in enumerate(rows):
        if not prompt or not answer:
            raise ValueError(f"pair {row // 2} has an empty prompt or answer")
        n, end = len(prompt), len(prompt) + len(answer)
        out["input_ids"][row, :end] = prompt + answer
        out["attention_mask"][row, :end] = 1
        out["response_mask"][row, n:end] = 1
        out["owner"][row, n:end] = row + 1
    return out


def lay_out_pairs(
    pairs: Sequence[Pair],
    *,
    batch_pairs: int | None = None,
    columns: int | None = None,
    pad_id: int = 0,
    share: bool = True,
    buckets: bool = False,
    multiple: int = 1,
) -> dict[str, np.ndarray]:
    """The arrays of :data:`PAIR_COLUMNS` for ``pairs`` (one micro-batch's, or a batch's).

    ``batch_pairs``: the pairs of the whole batch these are part of (``len(pairs)`` if
    None); each pair weighs ``1 / batch_pairs``. ``columns``: the unpacked rows' width
    (the longest row if None); packed rows are twice as wide. ``buckets`` / ``multiple``:
    packing's fixed bin counts for a backend that compiles per shape, and the multiple a
    bin count must be (:func:`strop.batch.packing.plan`). ``share=False``: no packing.
    """
    rows = pair_rows(pairs, columns, pad_id)
    plan = None
    if share:
        plan = packing.plan(
            rows["attention_mask"], multiple, buckets=buckets, bin_width=2.0,
            input_ids=rows["input_ids"], response_mask=rows["response_mask"],
        )  # fmt: skip
    if plan is None:
        laid = {
            "input_ids": rows["input_ids"],
            "attention_mask": rows["attention_mask"],
            "owner": rows["owner"],
            "positions": np.maximum(np.cumsum(rows["attention_mask"], axis=1) - 1, 0),
        }
    else:
        laid = plan.pack({name: rows[name] for name in ("input_ids", "attention_mask", "owner")})
    owner = laid.pop("owner")
    count = len(pairs)
    ids = 1 + 2 * np.arange(count)[:, None, None]
    chosen, rejected = owner[None] == ids, owner[None] == ids + 1
    weight = 1.0 / (count if batch_pairs is None else batch_pairs)
    return {
        "input_ids": laid["input_ids"].astype(np.int32),
        "attention_mask": laid["attention_mask"].astype(np.int32),
        "positions": laid["positions"].astype(np.int32),
        "answer_mask": (owner > 0).astype(np.float32),
        "chosen_masks": chosen.astype(np.float32),
        "rejected_masks": rejected.astype(np.float32),
        "chosen_tokens": chosen.sum((1, 2)).astype(np.float32),
        "rejected_tokens": rejected.sum((1, 2)).astype(np.float32),
        "pair_weights": np.full(count, weight, np.float32),
    }


def lay_out_chunks(
    pairs: Sequence[Pair],
    chunks: int,
    *,
    columns: int | None = None,
    pad_id: int = 0,
    share: bool = True,
    buckets: bool = False,
) -> dict[str, np.ndarray]:
    """A batch of pairs as ``chunks`` equal layouts (:func:`lay_out_pairs`, each pair
    weighing ``1 / len(pairs)``) stacked on the leading axis: the micro-batches (of every
    process, in order) a backend forwards one at a time. Chunk ``c`` holds the ``c``-th run
    of ``len(pairs) / chunks`` pairs; the chunks' rows are padded to the same count and
    width (rows attending to nothing, selected by no mask), so that the row arrays are
    ``[chunks * R, W]``, the masks ``[chunks * P, R, W]`` and the per-pair arrays
    ``[chunks * P]``: splitting each leading axis into ``chunks`` gives the chunks."""
    if len(pairs) % chunks:
        raise ValueError(f"{len(pairs)} pairs do not split into {chunks} micro-batches")
    per = len(pairs) // chunks
    laid = [
        lay_out_pairs(pairs[c * per : (c + 1) * per], batch_pairs=len(pairs), columns=columns,
                      pad_id=pad_id, share=share, buckets=buckets)
        for c in range(chunks)
    ]  # fmt: skip
    rows = max(layout["input_ids"].shape[0] for layout in laid)
    width = max(layout["input_ids"].shape[1] for layout in laid)
    out: dict[str, list[np.ndarray]] = {name: [] for name in PAIR_COLUMNS}
    for layout in laid:
        for name, array in layout.items():
            if array.ndim >= 2:  # [R, W] or [P, R, W]: pad the rows and the columns
                pad = [(0, 0)] * (array.ndim - 2) + [
                    (0, rows - array.shape[-2]), (0, width - array.shape[-1])
                ]  # fmt: skip
                array = np.pad(array, pad, constant_values=pad_id if name == "input_ids" else 0)
            out[name].append(array)
    return {name: np.concatenate(arrays) for name, arrays in out.items()}
