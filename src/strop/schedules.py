"""Learning-rate schedules as plain functions of the update count (backend-neutral).

The torch backend sets each update's learning rate from :func:`learning_rate`; the JAX
backend builds the same curve from optax schedules, and a test holds the two equal.
"""

from __future__ import annotations

import math

from strop.config import OptimConfig


def learning_rate(config: OptimConfig, total_steps: int, update: int) -> float:
    """The learning rate of optimizer update ``update`` (0-based) of ``total_steps``.

    Linear warmup from 0 to ``lr`` over ``warmup_steps`` updates, then constant, or a
    linear or cosine decay to 0 at ``total_steps`` (held at 0 after it).
    """
    if update < config.warmup_steps:
        return config.lr * update / config.warmup_steps
    decay_steps = max(total_steps - config.warmup_steps, 1)
    done = min(update - config.warmup_steps, decay_steps) / decay_steps
    if config.schedule == "linear":
        return config.lr * (1.0 - done)
    if config.schedule == "cosine":
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * done))
    return config.lr
