"""What a non-finite update's error names as its likely cause (strop.run.nonfinite)."""

from __future__ import annotations

import pytest

from strop.config import load_config
from strop.errors import NonFiniteError
from strop.run.nonfinite import count_skipped


def stopped(overrides: list[str], rewards: list[float] | None) -> str:
    """The message of the NonFiniteError a refused PPO (rewards given) or SFT step raises."""
    from strop.run.nonfinite import likely_causes

    config = load_config("ppo-lora-tiny", overrides)
    with pytest.raises(NonFiniteError) as info:
        count_skipped(
            {"skipped": 1.0, "loss": float("inf")},
            where="ppo iteration 1 policy update",
            skip=False,
            latest_checkpoint=lambda: None,
            causes=lambda: likely_causes(config, rewards),
        )
    return str(info.value)


@pytest.mark.parametrize(
    ("overrides", "rewards", "named"),
    [
        ([], [0.0, 1e30, -2.0], "likely cause: rewards reach 1e+30 (scale the reward"),
        (["ppo.kl_coef=1e30"], [0.0, 1.0], "likely cause: ppo.kl_coef=1e+30 (a huge coefficient)"),
        (["lora.alpha=1e30"], None, "likely cause: lora.alpha=1e+30 (adapters are scaled"),
        (["optim.lr=50"], None, "likely cause: optim.lr=50 (lower the learning rate)"),
    ],
)
def test_the_error_names_what_it_sees(overrides, rewards, named) -> None:
    """It always said "fix the data or lower the learning rate", also for a reward of 1e30."""
    message = stopped(overrides, rewards)
    assert named in message and "fix the data" not in message, message
    assert message.endswith("or set train.skip_nonfinite=true to skip such steps")


def test_with_nothing_in_sight_the_advice_is_the_usual_one() -> None:
    message = stopped([], [0.0, 1.0])
    assert "likely cause" not in message and "fix the data or lower the learning rate" in message
