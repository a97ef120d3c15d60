"""The torch backend's learning-rate curve equals the JAX backend's optax schedules.

optax evaluates in float32, so agreement is to float32 precision."""

from __future__ import annotations

import numpy as np
import pytest

from strop.backends.jax.train import learning_rate_schedule
from strop.config import OptimConfig
from strop.schedules import learning_rate


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_learning_rate_matches_optax(schedule, warmup):
    config = OptimConfig(lr=2e-3, schedule=schedule, warmup_steps=warmup)
    optax_schedule = learning_rate_schedule(config, total_steps=12)
    ours = [learning_rate(config, 12, step) for step in range(16)]
    theirs = [float(optax_schedule(step)) for step in range(16)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-12)
