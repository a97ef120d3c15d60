"""The ``distill:`` section's JSD settings: what ``distill.loss=jsd`` reads, their defaults,
and a bad value refused in one line naming it."""

from __future__ import annotations

import pytest

from strop.config import load_config
from strop.objectives.distill import DEFAULT_CHUNK_TOKENS, JsdObjective
from tests.unit.test_config import config_error


def test_jsd_loads_with_trl_defaults_and_makes_its_objective() -> None:
    config = load_config(None, ["distill.loss=jsd"])
    distill = config.distill
    assert (distill.loss, distill.beta, distill.temperature) == ("jsd", 0.5, 1.0)
    assert distill.chunk_tokens == DEFAULT_CHUNK_TOKENS
    tuned = load_config(
        None, ["distill.loss=jsd", "distill.beta=0", "distill.temperature=0.7",
               "distill.chunk_tokens=64"],
    )  # fmt: skip
    assert JsdObjective.from_config(tuned) == JsdObjective(
        beta=0.0, temperature=0.7, chunk_tokens=64
    )


@pytest.mark.parametrize(
    "override, named",
    [
        ("distill.beta=1.5", "distill.beta"),
        ("distill.beta=-0.1", "distill.beta"),
        ("distill.temperature=0", "distill.temperature"),
        ("distill.chunk_tokens=0", "distill.chunk_tokens"),
        ("distill.loss=forward_kl", "distill.loss"),
    ],
)
def test_a_bad_jsd_setting_is_one_line_naming_it(override: str, named: str) -> None:
    assert named in config_error(None, ["distill.loss=jsd", override])


def test_jsd_refuses_a_task_reward_it_would_not_read() -> None:
    message = config_error(None, ["distill.loss=jsd", "distill.reward_weight=0.5"])
    assert "distill.reward_weight" in message and "reverse_kl" in message
