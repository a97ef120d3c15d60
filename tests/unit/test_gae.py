"""The PPO bookkeeping oracle (strop.objectives.gae): hand-computed cases and properties.

Every array is [B, L] in the teacher-forcing layout: mask[b, t] = 1 marks response token
x_t, values[t] = V(x_<t). Values at masked columns are set to garbage (99) where it
matters, to show they are never read.
"""

from __future__ import annotations

import numpy as np
import pytest

from strop.objectives.gae import (
    advantages_and_returns,
    gae,
    last_response_index,
    masked_mean,
    masked_whiten,
    shift_values,
    token_rewards,
)

G = 99.0  # garbage at masked columns


def close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=1e-6, atol=1e-7)


# --- the value convention -------------------------------------------------------------


def test_shift_values_moves_each_value_one_column_right():
    raw = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], np.float32)
    values = shift_values(raw)
    close(values, [[0.0, 1.0, 2.0, 3.0], [0.0, 5.0, 6.0, 7.0]])
    assert values.dtype == np.float32
    # raw[:, -1] (the value of the finished sequence) is dropped: the episode is over.
    assert shift_values(np.zeros((1, 4, 1))).shape == (1, 4, 1)


def test_the_last_columns_raw_value_never_matters():
    """The raw value at the last response column (after x_last) only feeds column
    last+1, which is not a response column: changing it changes nothing."""
    mask = np.array([[0, 1, 1, 1, 0]], np.float32)
    rewards = token_rewards(np.array([1.0]), mask)
    raw = np.array([[0.1, 0.2, 0.3, 0.4, 0.5]])
    a1, r1 = advantages_and_returns(rewards, shift_values(raw), mask, 0.9, 0.8)
    raw[0, 3] = -123.0  # the value head's output after the last response token x_3
    a2, r2 = advantages_and_returns(rewards, shift_values(raw), mask, 0.9, 0.8)
    close(a1, a2)
    close(r1, r2)


# --- rewards ------------------------------------------------------------------------------


def test_score_goes_on_the_last_response_token():
    mask = np.array([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1]])
    rewards = token_rewards(np.array([1.0, -0.5, 2.0], np.float32), mask)
    assert rewards.dtype == np.float32
    close(
        rewards,
        [
            [0, 0, 0, 0, 1.0, 0, 0],
            [0, 0, -0.5, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 2.0],
        ],
    )
    assert last_response_index(mask).tolist() == [4, 2, 6]


def test_kl_in_reward_is_subtracted_on_response_tokens_only():
    mask = np.array([[0, 0, 1, 1, 1, 0]])
    kl = np.array([[7.0, 7.0, 0.1, 0.2, -0.1, 7.0]])  # 7s are off the response
    rewards = token_rewards(np.array([1.0]), mask, kl=kl, kl_coef=0.5)
    close(rewards, [[0, 0, -0.05, -0.1, 1.0 + 0.05, 0]])


def test_a_row_without_response_tokens_is_rejected():
    mask = np.array([[0, 1, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"rows \[1\] have no response token"):
        token_rewards(np.array([1.0, 1.0]), mask)
    with pytest.raises(ValueError, match="scores has shape"):
        token_rewards(np.array([1.0]), mask)


# --- hand-computed GAE -----------------------------------------------------------------


def test_one_token_responses():
    # prompt of 2, response of 1: A = r - v whatever gamma and lam; returns = r.
    mask = np.array([[0, 0, 1], [0, 0, 1]])
    values = np.array([[G, G, 0.5], [G, G, 0.2]])
    rewards = token_rewards(np.array([1.0, -0.5]), mask)
    for gamma, lam in [(1.0, 1.0), (0.9, 0.8), (0.0, 0.0)]:
        adv, ret = advantages_and_returns(rewards, values, mask, gamma, lam)
        close(adv, [[0, 0, 0.5], [0, 0, -0.7]])
        close(ret, [[0, 0, 1.0], [0, 0, -0.5]])


def test_eos_mid_sequence_then_right_padding_gamma_lam_one():
    # prompt x0 x1, response x2 x3 x4(EOS), padding x5 x6; score 1.
    mask = np.array([[0, 0, 1, 1, 1, 0, 0]])
    values = np.array([[G, G, 0.5, 0.6, 0.7, G, G]])
    rewards = token_rewards(np.array([1.0]), mask)
    adv, ret = advantages_and_returns(rewards, values, mask, gamma=1.0, lam=1.0)
    # A_t = (sum of future rewards) - v_t = 1 - v_t
    close(adv, [[0, 0, 0.5, 0.4, 0.3, 0, 0]])
    close(ret, [[0, 0, 1.0, 1.0, 1.0, 0, 0]])


def test_eos_mid_sequence_gamma_and_lam_below_one():
    """The worked example of docs/ppo.md (gamma 0.9, lam 0.8)."""
    mask = np.array([[0, 0, 1, 1, 1, 0, 0]])
    values = np.array([[G, G, 0.5, 0.6, 0.7, G, G]])
    rewards = token_rewards(np.array([1.0]), mask)
    adv, ret = advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=4: delta = 1 + 0.9*0 - 0.7 = 0.3;      A = 0.3
    # t=3: delta = 0 + 0.9*0.7 - 0.6 = 0.03;   A = 0.03 + 0.72*0.3   = 0.246
    # t=2: delta = 0 + 0.9*0.6 - 0.5 = 0.04;   A = 0.04 + 0.72*0.246 = 0.21712
    close(adv, [[0, 0, 0.21712, 0.246, 0.3, 0, 0]])
    close(ret, [[0, 0, 0.71712, 0.846, 1.0, 0, 0]])


def test_separate_lam_returns():
    mask = np.array([[0, 0, 1, 1, 1, 0, 0]])
    values = np.array([[G, G, 0.5, 0.6, 0.7, G, G]])
    rewards = token_rewards(np.array([1.0]), mask)
    adv, ret = advantages_and_returns(rewards, values, mask, 0.9, 0.8, lam_returns=1.0)
    close(adv, [[0, 0, 0.21712, 0.246, 0.3, 0, 0]])  # still lam = 0.8
    # lam_returns = 1: discounted reward-to-go, 0.9^2, 0.9, 1
    close(ret, [[0, 0, 0.81, 0.9, 1.0, 0, 0]])
    adv0, ret0 = advantages_and_returns(rewards, values, mask, 0.9, 0.8, lam_returns=0.0)
    # lam_returns = 0: one-step TD targets r_t + gamma * v_{t+1}
    close(ret0, [[0, 0, 0.54, 0.63, 1.0, 0, 0]])
    close(adv0, adv)


def test_kl_in_reward_flows_into_the_advantages():
    mask = np.array([[0, 1, 1]])
    values = np.array([[G, 0.0, 0.0]])
    rewards = token_rewards(np.array([1.0]), mask, kl=np.array([[0.0, 0.2, 0.4]]), kl_coef=0.5)
    close(rewards, [[0, -0.1, 0.8]])
    adv, ret = advantages_and_returns(rewards, values, mask, 1.0, 1.0)
    close(adv, [[0, 0.7, 0.8]])
    close(ret, [[0, 0.7, 0.8]])


def test_left_padded_prompts_of_different_lengths():
    # P = 3, T = 2. Row 0: prompt of 3, response of 2. Row 1: prompt of 1 (two pads on the
    # left), response of 1 then one pad. Response token t of every row is in column 3 + t.
    mask = np.array([[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]])
    values = np.array([[G, G, G, 0.2, 0.4], [G, G, G, 0.3, G]])
    rewards = token_rewards(np.array([1.0, 0.0]), mask)
    adv, ret = advantages_and_returns(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: t=4 delta = 1 - 0.4 = 0.6; t=3 delta = 0.4 - 0.2 = 0.2, A = 0.2 + 0.5*0.6 = 0.5
    # row 1: t=3 delta = 0 - 0.3
    close(adv, [[0, 0, 0, 0.5, 0.6], [0, 0, 0, -0.3, 0]])
    close(ret, [[0, 0, 0, 0.7, 1.0], [0, 0, 0, 0.0, 0]])


def test_several_lengths_in_one_batch():
    mask = np.array([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]])
    values = np.array([[G, 0.0, 0.0, 0.0, 0.0], [G, 0.4, 0.2, G, G], [G, 0.5, G, G, G]])
    rewards = token_rewards(np.array([1.0, 2.0, -1.0]), mask)
    adv, ret = advantages_and_returns(rewards, values, mask, gamma=0.5, lam=0.5)
    # row 0: values 0 so A_t = (gamma*lam)^(4-t) * 1 = 0.25^(4-t)
    # row 1: t=2 delta = 2 - 0.2 = 1.8; t=1 delta = 0.5*0.2 - 0.4 = -0.3, A = -0.3 + 0.25*1.8
    # row 2: A = -1 - 0.5
    close(
        adv,
        [
            [0, 0.015625, 0.0625, 0.25, 1.0],
            [0, 0.15, 1.8, 0, 0],
            [0, -1.5, 0, 0, 0],
        ],
    )
    close(
        ret,
        [
            [0, 0.015625, 0.0625, 0.25, 1.0],
            [0, 0.55, 2.0, 0, 0],
            [0, -1.0, 0, 0, 0],
        ],
    )


def test_holes_inside_a_response_are_skipped():
    """Carry-forward masking: a masked column inside a response passes next_value and the
    running advantage through, as if the column were not there."""
    values = np.array([[G, 0.5, G, 0.6, 0.7]])
    mask = np.array([[0, 1, 0, 1, 1]])
    rewards = token_rewards(np.array([1.0]), mask)
    adv = gae(rewards, values, mask, 0.9, 0.8)
    close(adv, [[0, 0.21712, 0, 0.246, 0.3]])  # the same numbers as the contiguous case


# --- whitening ---------------------------------------------------------------------------


def test_masked_whiten():
    x = np.array([[1.0, 2.0, 3.0, 100.0], [4.0, -100.0, 100.0, 100.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    # over the four unmasked entries 1, 2, 3, 4: mean 2.5, biased variance 1.25
    std = np.sqrt(1.25 + 1e-8)
    white = masked_whiten(x, mask)
    assert white.dtype == np.float32
    close(white, [[-1.5 / std, -0.5 / std, 0.5 / std, 0], [1.5 / std, 0, 0, 0]])
    scaled = masked_whiten(x, mask, shift_mean=False)
    close(
        scaled, [[2.5 - 1.5 / std, 2.5 - 0.5 / std, 2.5 + 0.5 / std, 0], [2.5 + 1.5 / std, 0, 0, 0]]
    )
    on = mask > 0
    assert abs(white[on].mean()) < 1e-6
    assert abs(white[on].std() - 1.0) < 1e-6
    with pytest.raises(ValueError, match="selects no entry"):
        masked_whiten(x, np.zeros_like(mask))


def test_masked_mean():
    x = np.array([[1.0, 2.0, 50.0], [3.0, 50.0, 50.0], [50.0, 50.0, 50.0]])
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert masked_mean(x, mask) == pytest.approx(2.0)
    close(masked_mean(x, mask, axis=1), [1.5, 3.0, 0.0])  # 0, not NaN, for an empty row
    assert masked_mean(x, np.zeros_like(mask)) == 0.0


# --- properties on random batches ---------------------------------------------------------


def random_batch(seed: int, batch: int = 6, width: int = 12):
    """Left-padded prompts then right-padded responses (possibly with holes), random
    rewards and values (garbage off the response)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, width), np.int64)
    for b in range(batch):
        start = rng.integers(1, width - 1)
        length = rng.integers(1, width - start + 1)
        mask[b, start : start + length] = 1
        if length > 2 and rng.random() < 0.5:  # a hole inside the response
            mask[b, start + rng.integers(1, length - 1)] = 0
    rewards = np.where(mask > 0, rng.normal(size=mask.shape), 0.0)
    values = np.where(mask > 0, rng.normal(size=mask.shape), G)
    return rewards, values, mask


@pytest.mark.parametrize("seed", range(5))
def test_gamma_lam_one_returns_are_the_sum_of_future_rewards(seed):
    rewards, values, mask = random_batch(seed)
    adv, ret = advantages_and_returns(rewards, values, mask, 1.0, 1.0)
    to_go = np.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]
    close(ret, np.where(mask > 0, to_go, 0.0))
    close(adv, np.where(mask > 0, to_go - values, 0.0))


@pytest.mark.parametrize("seed", range(5))
def test_advantages_and_returns_are_zero_off_the_response(seed):
    rewards, values, mask = random_batch(seed)
    for gamma, lam, lam_r in [(1.0, 0.95, None), (0.9, 0.7, 1.0), (0.5, 0.0, 0.3)]:
        adv, ret = advantages_and_returns(rewards, values, mask, gamma, lam, lam_r)
        assert np.all(adv[mask == 0] == 0)
        assert np.all(ret[mask == 0] == 0)


@pytest.mark.parametrize("seed", range(5))
def test_gae_on_a_row_equals_gae_on_its_compacted_response(seed):
    """Masked columns take no part: GAE of a row equals a plain GAE recursion over the
    row's response tokens alone (gamma, lam < 1)."""
    rewards, values, mask = random_batch(seed)
    gamma, lam = 0.9, 0.7
    adv = gae(rewards, values, mask, gamma, lam)
    for b in range(mask.shape[0]):
        cols = np.flatnonzero(mask[b])
        r, v = rewards[b, cols], values[b, cols]
        expected, last = np.zeros(len(cols)), 0.0
        for i in range(len(cols) - 1, -1, -1):
            next_v = v[i + 1] if i + 1 < len(cols) else 0.0
            last = r[i] + gamma * next_v - v[i] + gamma * lam * last
            expected[i] = last
        close(adv[b, cols], expected)


def test_lam_zero_is_the_one_step_td_error():
    rewards, values, mask = random_batch(11)
    adv = gae(rewards, values, mask, 0.9, 0.0)
    shifted_next = np.zeros_like(values)
    for b in range(mask.shape[0]):
        cols = np.flatnonzero(mask[b])
        shifted_next[b, cols[:-1]] = values[b, cols[1:]]
    close(adv, np.where(mask > 0, rewards + 0.9 * shifted_next - values, 0.0))
