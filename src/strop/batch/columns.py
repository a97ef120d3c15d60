"""Fixed widths for a backend that compiles each shape (numpy only).

Such a backend (JAX) pads what it compiles itself: told the run's longest prompt once
(``ActorCritic.expect_prompts``), it left-pads every prompt it samples to one prompt width
and right-pads every rollout batch it forwards or trains on to one rollout width, so that
a PPO run compiles its sampler and its steps once, whatever the prompts drawn and the
response lengths. The core passes plain prompts and rows at their own widths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLUMN_MULTIPLE = 16
"""Fixed widths (prompt columns, rollout batches) are rounded up to a multiple of this."""


def round_up(n: int, multiple: int = COLUMN_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class FixedWidths:
    """A run's widths: ``prompt`` (``None``: each call's own) and ``rollout`` (``None``:
    each batch's own)."""

    prompt: int | None = None
    rollout: int | None = None

    @classmethod
    def of(cls, longest_prompt: int, max_new_tokens: int) -> FixedWidths:
        """The longest prompt rounded up, and that plus the response budget rounded up."""
        prompt = round_up(longest_prompt)
        return cls(prompt, round_up(prompt + max_new_tokens))

    def pad(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``batch``'s ``[B, L]`` arrays right-padded with zeros to the rollout width (as
        they are without one, or when they are wider); padding is masked."""
        columns = batch["attention_mask"].shape[1]
        if self.rollout is None or columns >= self.rollout:
            return batch
        wide = ((0, 0), (0, self.rollout - columns))
        return {k: np.pad(v, wide) if v.ndim == 2 else v for k, v in batch.items()}
