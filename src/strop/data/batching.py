"""Fixed-shape numpy batches for the SFT loop, a pure function of (seed, step).

The data stream is the examples in a seeded permutation per epoch, one epoch after the
other; batch ``step`` holds stream positions ``step * B ... step * B + B - 1``. Position p
belongs to epoch ``p // n`` and is example ``perm(epoch)[p % n]`` with
``perm(epoch) = np.random.default_rng((seed, epoch)).permutation(n)``. So resuming at a step
needs nothing but the step, and every example appears once per epoch (a batch may straddle
two epochs). There is no length bucketing: order depends on (seed, epoch) only.

Batch arrays (right-padded): ``input_ids [B, L] int32`` (``pad_id`` in padding),
``attention_mask [B, L] int32`` (1 on real tokens), ``loss_mask [B, L] float32`` (1 where
``x_t`` is a target, see :mod:`strop.data.sft`). ``L`` is the batch's longest sequence
rounded up to a multiple of ``pad_to_multiple`` and capped at ``max_length``, so there are
at most ``ceil(max_length / pad_to_multiple)`` distinct shapes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from strop.data.sft import TokenizedExample

Batch = dict[str, np.ndarray]


class SftBatcher:
    """Deterministic, resumable batches of tokenized examples (see the module docstring)."""

    def __init__(
        self,
        examples: Sequence[TokenizedExample],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        pad_id: int = 0,
        pad_to_multiple: int = 64,
        max_length: int = 512,
    ) -> None:
        if not examples:
            raise ValueError("SftBatcher needs at least one example")
        if batch_size < 1 or pad_to_multiple < 1 or max_length < 1:
            raise ValueError(
                f"batch_size ({batch_size}), pad_to_multiple ({pad_to_multiple}) and "
                f"max_length ({max_length}) must be positive"
            )
        longest = max(len(e) for e in examples)
        if longest > max_length:
            raise ValueError(f"an example has {longest} tokens, more than max_length={max_length}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.pad_id = pad_id
        self.pad_to_multiple = pad_to_multiple
        self.max_length = max_length
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_examples(self) -> int:
        """Number of examples in one epoch."""
        return len(self.examples)

    @property
    def steps_per_epoch(self) -> float:
        """Batches per pass over the data (fractional when B does not divide n)."""
        return self.num_examples / self.batch_size

    def epoch_of(self, step: int) -> int:
        """The epoch (0-based) of the first row of batch ``step``."""
        return step * self.batch_size // self.num_examples

    def permutation(self, epoch: int) -> np.ndarray:
        """Example order ``[n] int64`` of an epoch: seeded by (seed, epoch), or identity."""
        if epoch not in self._perms:
            n = self.num_examples
            if self.shuffle:
                order = np.random.default_rng((self.seed, epoch)).permutation(n)
            else:
                order = np.arange(n)
            if len(self._perms) >= 4:  # consecutive steps touch one or two epochs
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = order
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """Example indices ``[B]`` of batch ``step`` (a pure function of seed and step)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.num_examples
        positions = range(step * self.batch_size, (step + 1) * self.batch_size)
        return np.array([self.permutation(p // n)[p % n] for p in positions], dtype=np.int64)

    def batch(self, step: int) -> Batch:
        """Batch ``step``: ``input_ids``, ``attention_mask``, ``loss_mask``, each ``[B, L]``."""
        return self._collate([self.examples[i] for i in self.indices(step)], self.batch_size)

    def iter_eval_batches(self, batch_size: int) -> Iterator[tuple[Batch, int]]:
        """All examples once, in order, as ``(batch, num_real_rows)``. Every batch has
        ``batch_size`` rows; the last is filled with rows of ``pad_id`` whose attention and
        loss masks are all 0 (backends must not produce NaN for fully masked rows)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        for start in range(0, self.num_examples, batch_size):
            rows = self.examples[start : start + batch_size]
            yield self._collate(rows, batch_size), len(rows)

    def length_for(self, longest: int) -> int:
        """Padded length L for a batch whose longest sequence has ``longest`` tokens."""
        multiple = self.pad_to_multiple
        return min(-(-max(longest, 1) // multiple) * multiple, self.max_length)

    def _collate(self, rows: Sequence[TokenizedExample], num_rows: int) -> Batch:
        length = self.length_for(max(len(e) for e in rows))
        input_ids = np.full((num_rows, length), self.pad_id, dtype=np.int32)
        attention_mask = np.zeros((num_rows, length), dtype=np.int32)
        loss_mask = np.zeros((num_rows, length), dtype=np.float32)
        for r, example in enumerate(rows):
            t = len(example)
            input_ids[r, :t] = example.input_ids
            attention_mask[r, :t] = 1
            loss_mask[r, :t] = example.loss_mask
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
