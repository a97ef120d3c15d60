"""What an SFT update optimises, as loss weights: the mean next-token cross-entropy over
the batch's target tokens.

As with PPO (:mod:`strop.objectives.ppo`), the core gives every update weights
``w [B, L]`` with the batch's loss ``== (nll * w).sum()``, where ``nll[:, t]`` is the
cross-entropy of predicting ``x_t`` from ``x_<t`` (column 0 predicts nothing and weighs
0). A backend sums ``nll * w`` over whatever rows it holds (a micro-batch, a rank's
shard) and the sums add up to the batch's token mean exactly, with no division by a local
count (ARCHITECTURE invariant 9).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

SFT_BATCH = ("input_ids", "attention_mask", "loss_weights")
"""The arrays an SFT update reads."""


def target_tokens(loss_mask: np.ndarray) -> float:
    """How many tokens of a batch are targets (``loss_mask`` on ``x_1 ... x_{L-1}``)."""
    return float(np.asarray(loss_mask, np.float32)[:, 1:].sum())


def token_mean_weights(loss_mask: np.ndarray) -> np.ndarray:
    """``[B, L] float32`` weights of the token mean over the target tokens of the batch."""
    weights = np.zeros(np.shape(loss_mask), np.float32)
    weights[:, 1:] = np.asarray(loss_mask, np.float32)[:, 1:]
    return weights / max(target_tokens(loss_mask), 1.0)


def with_loss_weights(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``batch`` with its ``loss_weights`` (the token mean unless it has some already)."""
    if "loss_weights" in batch:
        return dict(batch)
    return {**batch, "loss_weights": token_mean_weights(batch["loss_mask"])}
