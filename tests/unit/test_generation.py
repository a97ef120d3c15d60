"""The samplers' shared contract (strop.generation): which prompts a sampler prefills once."""

from __future__ import annotations

import pytest

from strop.generation import prompt_repeats


@pytest.mark.parametrize(
    ("prompts", "repeats"),
    [
        ([[1, 2], [1, 2], [3], [3]], 2),  # a prompt's rollouts side by side, as PPO asks
        ([[1, 2]] * 4 + [[3]] * 4 + [[1, 2]] * 4, 4),  # a prompt drawn twice: runs still
        ([[5]] * 6, 6),
        ([[1], [2], [3]], 1),  # validation: every prompt once
        ([[1], [1], [2]], 1),  # runs of different lengths
        ([[1], [1], [2], [3]], 1),
        ([[1], [2], [1], [2]], 1),  # equal prompts apart: not side by side
        ([[1, 2], [1, 2, 3]], 1),
        ([[7]], 1),
    ],
)
def test_prompt_repeats_finds_runs_of_one_length(prompts, repeats):
    assert prompt_repeats(prompts) == repeats
