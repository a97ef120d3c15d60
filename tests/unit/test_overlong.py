"""``ppo.overlong``: DAPO's soft length penalty and overlong filtering."""

from __future__ import annotations

import numpy as np

from strop.rl.experience import minibatches
from strop.rl.overlong import length_penalty, without_truncated


def test_the_penalty_grows_linearly_over_the_buffer():
    # max 10 tokens, buffer 4: 0 up to 6 tokens, then -0.25 per token to -1 at 10
    lengths = np.array([3, 6, 7, 8, 10])
    got = length_penalty(lengths, 10, 4, penalty=1.0, truncated=lengths == 10)
    np.testing.assert_allclose(got, [0, 0, -0.25, -0.5, -1.0])


def test_without_a_buffer_only_truncated_responses_are_penalised():
    """A response that ended with EOS exactly at max_new_tokens (finish reason "stop")
    was penalised like one cut there (length >= max_new_tokens was the test)."""
    lengths, truncated = np.array([9, 10, 10]), np.array([False, False, True])
    got = length_penalty(lengths, 10, 0, 0.5, truncated=truncated)
    np.testing.assert_allclose(got, [0, 0, -0.5])


def test_masked_truncated_rows_weigh_nothing_in_the_losses():
    mask = np.array([[0, 1, 1], [0, 1, 1], [1, 1, 0]], np.float32)
    arrays = {"input_ids": np.ones((3, 3), np.int32), "response_mask": mask}
    kept = without_truncated(arrays, np.array([False, True, False]))
    assert arrays["response_mask"][1].sum() == 2  # the input is not modified
    (mini,) = minibatches(kept, 3, "token_mean", np.random.default_rng(0))
    rows = {tuple(r) for r in mini["response_mask"].tolist()}
    assert (0.0, 0.0, 0.0) in rows
    weights = mini["loss_weights"]
    assert (
        np.isclose(weights.sum(), 1.0) and (weights[mini["response_mask"].sum(1) == 0] == 0).all()
    )


def test_a_buffer_longer_than_the_responses_is_refused():
    import pytest

    from strop.config import load_config
    from strop.errors import ConfigError

    with pytest.raises(ConfigError, match=r"ppo.overlong_buffer \(50\) is longer than"):
        load_config("ppo-lora-tiny", ["ppo.overlong_buffer=50"])  # max_new_tokens 48
