"""Responses cut by ``generation.max_new_tokens``: what ``ppo.overlong`` does with them.

A truncated response (finish reason ``length``) has no ending to score, so its reward
says little about its tokens. DAPO (Yu et al. 2025) handles it two ways, both here:

- ``mask``: *overlong filtering*: truncated responses stay in the batch (their rewards
  still enter group baselines and returns) but carry no weight in the losses;
- ``penalty``: *soft overlong punishment*: a length penalty added to the score, 0 up to
  ``max_new_tokens - ppo.overlong_buffer`` tokens, then growing linearly to
  ``-ppo.overlong_penalty`` at ``max_new_tokens``; with no buffer (``overlong_buffer=0``)
  ``-ppo.overlong_penalty`` for truncated responses only: one that ended (EOS or a stop
  string) on its last allowed token has its ending;
- ``keep`` (default): neither.
"""

from __future__ import annotations

import numpy as np


def length_penalty(
    lengths: np.ndarray, max_new_tokens: int, buffer: int, penalty: float, *, truncated: np.ndarray
) -> np.ndarray:
    """DAPO's soft overlong penalty per response ``[B]`` (0 or negative); ``truncated``:
    the responses cut by ``max_new_tokens`` (finish reason ``length``)."""
    lengths = np.asarray(lengths, np.float64)
    if buffer <= 0:
        return np.where(np.asarray(truncated, bool), -penalty, 0.0)
    start = max_new_tokens - buffer
    return -penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)


def without_truncated(arrays: dict[str, np.ndarray], truncated: np.ndarray) -> dict:
    """``arrays`` with the truncated rows' ``response_mask`` zeroed: the mini-batches'
    loss weights then leave them out of every loss."""
    mask = arrays["response_mask"].copy()
    mask[np.asarray(truncated, bool)] = 0
    return {**arrays, "response_mask": mask}
