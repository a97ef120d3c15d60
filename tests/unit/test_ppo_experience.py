"""The PPO loop's numpy pieces: loss weights, column padding, prompt draws, experience."""

from __future__ import annotations

import numpy as np
import pytest

from strop.batch.columns import FixedWidths
from strop.config import Config, PpoConfig
from strop.objectives.ppo import PolicyObjective, ValueObjective, aggregation_weights
from strop.rl.experience import build_experience, minibatches
from strop.rl.prompts import PromptSet
from tests.losses_reference import aggregate


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("seed", range(5))
def test_weighted_sums_equal_the_aggregate(mode, seed):
    rng = np.random.default_rng(seed)
    mask = (rng.random((6, 9)) < 0.5).astype(np.float32)
    mask[2] = 0  # a row without response tokens counts for nothing
    values = rng.normal(size=mask.shape)
    weights = aggregation_weights(mask, mode, horizon=12)
    expected = aggregate(values, mask, mode, horizon=12)
    assert np.isclose((values * weights).sum(), expected, atol=1e-6)
    # split over rows (micro-batches, ranks): the parts add up to the whole
    halves = (values[:3] * weights[:3]).sum() + (values[3:] * weights[3:]).sum()
    assert np.isclose(halves, expected, atol=1e-6)


def test_dr_grpo_divides_each_sequence_s_token_sum_by_the_length_budget():
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    values = np.array([[2.0, 4.0, 9, 9], [1.0, 1.0, 1.0, 1.0], [9, 9, 9, 9]])
    # rows with a response: (2 + 4) / 8 and 4 / 8, averaged over those 2 rows
    assert aggregate(values, mask, "seq_mean_token_sum_norm", horizon=8) == (6 / 8 + 4 / 8) / 2
    with pytest.raises(ValueError, match="needs the horizon"):
        aggregation_weights(mask, "seq_mean_token_sum_norm")


def test_weights_of_an_empty_batch_are_zero():
    assert not aggregation_weights(np.zeros((2, 3)), "token_mean").any()


def test_fixed_widths_pad_every_rollout_array_with_masked_zeros():
    widths = FixedWidths.of(longest_prompt=17, max_new_tokens=40)
    assert (widths.prompt, widths.rollout) == (32, 80)
    batch = {
        "input_ids": np.ones((2, 57), np.int32), "attention_mask": np.ones((2, 57), np.int32),
        "response_mask": np.ones((2, 57)), "scores": np.ones(2),
    }  # fmt: skip
    padded = widths.pad(batch)
    assert {k: v.shape for k, v in padded.items()} == {
        "input_ids": (2, 80), "attention_mask": (2, 80), "response_mask": (2, 80), "scores": (2,),
    }  # fmt: skip
    assert not padded["response_mask"][:, 57:].any() and not padded["attention_mask"][:, 57:].any()
    assert widths.pad(padded) is padded and FixedWidths().pad(batch) is batch


def test_prompt_draws_cover_each_prompt_once_per_pass_and_repeat_exactly():
    prompts = PromptSet(ids=[[i] for i in range(10)], golds=["0"] * 10, texts=[""] * 10)
    first_pass = [i for step in range(5) for i in prompts.draw(step, 2, seed=3)]
    assert sorted(first_pass) == list(range(10))
    assert prompts.draw(7, 4, seed=3) == prompts.draw(7, 4, seed=3)  # resumable
    assert len(prompts.draw(2, 4, seed=3)) == 4  # a draw that crosses a pass boundary
    assert prompts.draw(0, 2, seed=3) != prompts.draw(0, 2, seed=4)


def test_experience_puts_the_score_on_the_last_token_and_whitens():
    mask = np.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], np.float32)
    batch = {"input_ids": np.ones((2, 5), np.int32), "attention_mask": np.ones((2, 5)),
             "response_mask": mask}  # fmt: skip
    zeros = np.zeros((2, 5), np.float32)
    ppo = PpoConfig(prompts_per_step=1, num_generations_per_prompt=2, mini_batch_size=2,
                    kl_coef=0.0, gamma=1.0, lam=1.0, whiten_advantages=False)  # fmt: skip
    arrays, stats = build_experience(batch, np.array([1.0, 0.0]), zeros, zeros, zeros, ppo)
    np.testing.assert_allclose(arrays["returns"], np.array([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]))
    assert stats["policy/kl"] == 0.0
    whitened, _ = build_experience(
        batch, np.array([1.0, 0.0]), zeros, zeros, zeros,
        ppo.model_copy(update={"whiten_advantages": True}),
    )  # fmt: skip
    on = mask > 0
    assert abs(whitened["advantages"][on].mean()) < 1e-6
    minis = list(minibatches(arrays, 1, "token_mean", np.random.default_rng(0)))
    assert len(minis) == 2 and all(m["loss_weights"].sum() == pytest.approx(1.0) for m in minis)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_reward_is_bounded_per_token(estimator):
    """A token the reference finds absurd (log-ratio -15: k3 was e^15 - 16 = 3.3e6) costs
    at most kl_coef * 10 in the reward, like verl's clamp."""
    mask = np.array([[0, 1, 1, 1, 0]], np.float32)
    batch = {"input_ids": np.ones((1, 5), np.int32), "attention_mask": np.ones((1, 5)),
             "response_mask": mask}  # fmt: skip
    old = np.array([[0.0, -16.0, -1.0, -2.0, 0.0]], np.float32)
    ref = np.array([[0.0, -1.0, -1.0, -40.0, 0.0]], np.float32)  # d = -15, 0, 38
    ppo = PpoConfig(prompts_per_step=1, num_generations_per_prompt=1, mini_batch_size=1,
                    kl_coef=0.5, kl_in_reward=True, kl_estimator=estimator, gamma=1.0,
                    lam=1.0, whiten_advantages=False)  # fmt: skip
    zeros = np.zeros((1, 5), np.float32)
    arrays, stats = build_experience(batch, np.array([1.0]), old, ref, zeros, ppo)
    kl = {"k1": [-10.0, 0.0, 10.0], "k2": [10.0, 0.0, 10.0], "k3": [10.0, 0.0, 10.0]}[estimator]
    rewards = np.array([0.0, 0.0, 1.0]) - 0.5 * np.array(kl)
    # lam = gamma = 1, values 0: the return is the reward-to-go
    np.testing.assert_allclose(arrays["returns"][0, 1:4], np.cumsum(rewards[::-1])[::-1])
    assert stats["policy/kl"] == pytest.approx(np.mean(kl))


@pytest.mark.parametrize(
    "settings",
    [
        {"kl_coef": 0.0},
        {"kl_coef": 0.1, "kl_in_reward": False},  # the KL is a loss term: ref_logprobs
        {"kl_coef": 0.1, "kl_in_reward": True},
        {"advantage_estimator": "grpo", "kl_coef": 0.0},  # critic-free: no critic update
        {"advantage_estimator": "grpo", "kl_coef": 0.1, "kl_in_reward": False},
    ],
)
def test_each_objective_names_the_arrays_its_update_gets(settings):
    """The core decides what an update reads (``batch_names``), and the mini-batches it
    hands out carry exactly that and nothing the objective does not know about."""
    ppo = PpoConfig(prompts_per_step=1, num_generations_per_prompt=2, mini_batch_size=2,
                    **settings)  # fmt: skip
    config = Config(ppo=ppo)
    policy, value = PolicyObjective.from_config(config), ValueObjective.from_config(config)
    mask = np.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], np.float32)
    batch = {"input_ids": np.ones((2, 5), np.int32), "attention_mask": np.ones((2, 5)),
             "response_mask": mask}  # fmt: skip
    old = np.full((2, 5), -1.0, np.float32)
    ref = old if ppo.reference_forward else None
    values = np.zeros((2, 5), np.float32) if ppo.has_critic else None
    arrays, _ = build_experience(batch, np.array([1.0, 0.0]), old, ref, values, ppo)
    needed = set(policy.batch_names) | (set(value.batch_names) if ppo.has_critic else set())
    for mini in minibatches(arrays, 2, "token_mean", np.random.default_rng(0)):
        assert needed <= set(mini), needed - set(mini)
    assert ("ref_logprobs" in policy.batch_names) == policy.kl_in_loss


def test_mini_batches_of_groups_keep_each_prompt_s_rollouts_together():
    rows, group = 16, 4
    arrays = {
        "input_ids": np.arange(rows)[:, None] * np.ones((1, 3), np.int64),
        "response_mask": np.ones((rows, 3), np.float32),
    }
    seen = []
    for mini in minibatches(arrays, 8, "token_mean", np.random.default_rng(0), group=group):
        ids = mini["input_ids"][:, 0]
        runs = ids.reshape(-1, group)  # whole groups, each in its own order
        np.testing.assert_array_equal(runs, runs[:, :1] + np.arange(group))
        assert np.all(runs[:, 0] % group == 0)
        seen += list(ids)
    assert sorted(seen) == list(range(rows))  # ... every rollout once
    orders = {
        tuple(m["input_ids"][:, 0])
        for seed in range(20)
        for m in minibatches(arrays, 8, "token_mean", np.random.default_rng(seed), group=group)
    }
    assert len(orders) > 2  # the groups are shuffled
    # groups of one are the rows' own shuffle, draw for draw (as before groups existed)
    single = minibatches(arrays, 8, "token_mean", np.random.default_rng(5), group=1)
    order = np.concatenate([m["input_ids"][:, 0] for m in single])
    np.testing.assert_array_equal(order, np.random.default_rng(5).permutation(rows))
    with pytest.raises(ValueError, match="groups of 3"):
        next(minibatches(arrays, 8, "token_mean", np.random.default_rng(0), group=3))


@pytest.mark.parametrize(
    ("mini_batch_size", "groups", "expected"), [(8, True, 4), (8, False, 1), (6, True, 1)]
)
def test_the_mini_batch_group_is_a_prompt_s_rollouts_when_it_divides(
    mini_batch_size, groups, expected
):
    ppo = PpoConfig(
        prompts_per_step=6, num_generations_per_prompt=4, mini_batch_size=mini_batch_size,
        mini_batch_groups=groups,
    )  # fmt: skip
    assert ppo.mini_batch_group == expected
