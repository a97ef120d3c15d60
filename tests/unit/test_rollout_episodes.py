"""Training on episodes: Rollout.from_episodes lays multi-turn episodes out with holes
(environment tokens) in the response mask; GAE and the critic-free estimators skip them."""

from __future__ import annotations

import numpy as np
import pytest

from strop.agents.calculator import calculator_environment
from strop.agents.rollout import RolloutLimits, run_episodes
from strop.objectives import estimators, gae
from strop.rl.rollout import Rollout
from tests.unit.test_agents_rollout import RECORDS, SCRIPTS, Scripted, tok  # noqa: F401


@pytest.fixture(scope="module")
def outcomes(tok):  # noqa: F811
    limits = RolloutLimits(max_turns=4, max_new_tokens=64, max_episode_tokens=2048)
    return run_episodes(RECORDS, calculator_environment, tok, Scripted(tok, SCRIPTS), limits)


def test_episodes_become_rows_with_holes_where_the_environment_spoke(tok, outcomes):  # noqa: F811
    rollout = Rollout.from_episodes(outcomes, tok)
    batch = rollout.teacher_forcing_batch(tok.pad_token_id)
    width = rollout.prompt_width
    for row, outcome in enumerate(outcomes):
        cols = outcome.episode.columns()
        on = np.flatnonzero(cols.sampled)
        first, end = on[0], on[-1] + 1
        n = int(rollout.lengths[row])
        assert rollout.prompt_ids[row] == cols.ids[:first].tolist()
        assert n == end - first and rollout.finish_reasons[row] == "stop"
        np.testing.assert_array_equal(rollout.response_ids[row, :n], cols.ids[first:end])
        np.testing.assert_array_equal(rollout.response_mask[row, :n], cols.sampled[first:end])
        assert not rollout.response_mask[row, n:].any()
        lp = np.where(cols.sampled[first:end] > 0, cols.logprobs[first:end], 0.0)
        np.testing.assert_allclose(rollout.logprobs[row, :n], lp)
        # Teacher forcing: the whole episode is attended to (holes too), only sampled
        # tokens are targets.
        ids = batch["input_ids"][row, width - first : width + n]
        np.testing.assert_array_equal(ids, cols.ids[:end])
        assert batch["attention_mask"][row, width - first : width + n].all()
        assert not batch["attention_mask"][row, width + n :].any()
        np.testing.assert_array_equal(
            batch["response_mask"][row, width : width + n], cols.sampled[first:end]
        )
        turns = len(SCRIPTS[RECORDS[row]["question"]])
        holes = np.diff(rollout.response_mask[row, :n]) > 0  # an env stretch then a turn
        assert holes.sum() == turns - 1
    assert rollout.response_texts == ["#### 56088", "#### 7", "#### 134"]
    assert rollout.reward_parts == [{"correct": 1.0}] * 3
    # A bare Episode works too; a truncated outcome finishes "length"; a failed one is refused.
    bare = Rollout.from_episodes([o.episode for o in outcomes], tok)
    np.testing.assert_array_equal(bare.response_ids, rollout.response_ids)
    assert bare.reward_parts == [{}] * 3
    outcomes[0].truncated = True
    try:
        assert Rollout.from_episodes(outcomes, tok).finish_reasons[0] == "length"
    finally:
        outcomes[0].truncated = False
    broken = type(outcomes[0])(episode=None, error="reset raised")
    with pytest.raises(ValueError, match="never started"):
        Rollout.from_episodes([broken], tok)


def verl_gae(rewards, values, mask, gamma, lam):
    """An independent port of verl's multi-turn GAE (core_algos.compute_gae_advantage_return,
    before its whitening): a mask-0 column passes next value and advantage through."""
    next_values = np.zeros(rewards.shape[0])
    last = np.zeros(rewards.shape[0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_ = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = last_ * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    advantages = np.stack(out[::-1], axis=1)
    return advantages, advantages + values


def holey_masks(rng, rows: int, width: int) -> np.ndarray:
    """Prompt columns, then alternating sampled turns and environment holes, then padding."""
    mask = np.zeros((rows, width))
    for row in range(rows):
        t = int(rng.integers(0, 4))
        while t < width - 2:
            turn = int(rng.integers(1, 5))
            mask[row, t : t + turn] = 1
            t += turn + int(rng.integers(1, 5))
            if rng.random() < 0.2:
                break
    return mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8)])
def test_gae_over_holes_equals_verls_multi_turn_gae(gamma, lam):
    rng = np.random.default_rng(int(gamma * 10 + lam * 100))
    mask = holey_masks(rng, 16, 40)
    assert ((np.diff(mask, axis=1) > 0).sum(axis=1) > 1).any()  # rows with holes
    rewards = rng.normal(size=mask.shape) * mask
    values = rng.normal(size=mask.shape)
    ours, returns = gae.advantages_and_returns(rewards, values, mask, gamma, lam)
    theirs, their_returns = verl_gae(rewards, values, mask, gamma, lam)
    on = mask > 0
    np.testing.assert_allclose(ours[on], theirs[on], rtol=0, atol=1e-9)
    np.testing.assert_allclose(returns[on], their_returns[on], rtol=0, atol=1e-9)
    assert not ours[~on].any() and not returns[~on].any()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_critic_free_advantages_are_zero_on_environment_tokens(estimator):
    rng = np.random.default_rng(7)
    mask = holey_masks(rng, 8, 30)
    mask[:, 5] = 1  # every row has a response token
    scores = rng.random(8)
    kl = rng.normal(size=mask.shape)
    adv = estimators.token_advantages(
        estimator, scores, mask, group_size=4, gamma=0.9, kl=kl, kl_coef=0.1
    )
    assert not adv[mask == 0].any()
    assert np.count_nonzero(adv[mask > 0]) == (mask > 0).sum()
    if estimator == "reinforce_pp":  # the discounted return skips the holes
        rewards = gae.token_rewards(scores, mask, kl=kl, kl_coef=0.1)
        returns, _ = verl_gae(rewards, np.zeros_like(rewards), mask, 0.9, 1.0)
        np.testing.assert_allclose(adv, gae.masked_whiten(returns * mask, mask) * mask, atol=1e-6)
