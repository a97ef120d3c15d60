"""The critic-free advantage estimators on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from strop.objectives import estimators

SCORES = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])  # two prompts x ... see each test


def test_grpo_is_the_score_standardised_within_its_prompt_s_group():
    # groups of 3: [1, 0, 0] (mean 1/3, unbiased std 1/sqrt(3)) and [1, .5, .5]
    adv = estimators.grpo(SCORES, 3)
    std = np.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # = 1/sqrt(3)
    expected_first = np.array([2 / 3, -1 / 3, -1 / 3]) / (std + estimators.GROUP_EPS)
    np.testing.assert_allclose(adv[:3], expected_first)
    np.testing.assert_allclose(adv[:3], [1.1547, -0.57735, -0.57735], atol=1e-4)
    np.testing.assert_allclose(adv[3:], expected_first, rtol=1e-5)  # shifted and scaled alike


def test_dr_grpo_only_centres():
    np.testing.assert_allclose(
        estimators.grpo(SCORES, 3, std_normalize=False),
        [2 / 3, -1 / 3, -1 / 3, 1 / 3, -1 / 6, -1 / 6],
    )


def test_rloo_subtracts_the_mean_of_the_other_responses():
    # [1, 0, 0]: 1 - 0, 0 - 0.5, 0 - 0.5; [1, .5, .5]: 1 - .5, .5 - .75, .5 - .75
    np.testing.assert_allclose(estimators.rloo(SCORES, 3), [1, -0.5, -0.5, 0.5, -0.25, -0.25])


def test_a_group_of_equal_scores_has_no_advantage_and_is_counted():
    scores = np.array([1.0, 1.0, 0.0, 1.0])
    assert estimators.grpo(scores, 2)[:2].tolist() == [0.0, 0.0]
    assert estimators.rloo(scores, 2)[:2].tolist() == [0.0, 0.0]
    assert estimators.equal_score_groups(scores, 2) == 1
    assert estimators.equal_score_groups(np.zeros(6), 3) == 2


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_refuse_groups_of_one(estimator):
    with pytest.raises(ValueError, match="at least 2 responses"):
        getattr(estimators, estimator)(SCORES, 1)
    with pytest.raises(ValueError, match="do not split"):
        getattr(estimators, estimator)(SCORES, 4)


def test_reinforce_pp_whitens_discounted_returns_of_token_rewards():
    mask = np.array([[0, 1, 1, 1], [0, 1, 1, 0]], np.float32)
    scores = np.array([1.0, 0.0])
    kl = np.full(mask.shape, 0.1)
    gamma, coef = 0.5, 1.0
    # token rewards: row 0: [-, -.1, -.1, 1 - .1]; row 1: [-, -.1, -.1, -]
    # returns (gamma .5): row 0: t3 .9, t2 -.1 + .45 = .35, t1 -.1 + .175 = .075
    #                     row 1: t2 -.1, t1 -.1 - .05 = -.15
    returns = np.array([0.075, 0.35, 0.9, -0.15, -0.1])
    expected = (returns - returns.mean()) / np.sqrt(returns.var() + 1e-8)
    adv = estimators.reinforce_pp(scores, mask, gamma, kl=kl, kl_coef=coef)
    np.testing.assert_allclose(adv[mask > 0], expected, rtol=1e-6)
    assert not adv[mask == 0].any()


def test_token_advantages_put_a_response_s_advantage_on_each_of_its_tokens():
    mask = np.array([[0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1]], np.float32)
    scores = np.array([1.0, 0.0, 0.0, 0.0])
    adv = estimators.token_advantages("rloo", scores, mask, group_size=2)
    np.testing.assert_allclose(adv, [[0, 1, 1], [0, -1, 0], [0, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="not a critic-free estimator"):
        estimators.token_advantages("gae", scores, mask, group_size=2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ppo.advantage_estimator=grpo", "ppo.num_generations_per_prompt=1",
          "ppo.mini_batch_size=8"], "needs ppo.num_generations_per_prompt >= 2"),
        (["ppo.advantage_estimator=rloo", "ppo.kl_coef=0.1", "ppo.kl_in_reward=true"],
         "put the KL in the loss"),
        (["ppo.advantage_estimator=reinforce_pp", "ppo.critic_warmup_steps=2"], "has no critic"),
    ],
)  # fmt: skip
def test_config_refuses_what_a_critic_free_estimator_cannot_do(overrides, message):
    from strop.config import load_config
    from strop.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config("ppo-lora-tiny", overrides)
    grpo = load_config("ppo-lora-tiny", ["ppo.advantage_estimator=grpo", "ppo.kl_in_reward=false"])
    assert not grpo.ppo.has_critic
