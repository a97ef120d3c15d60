"""Per-token rewards, values, GAE advantages and returns: the numpy oracle of PPO's
bookkeeping, and the place its token convention is written down.

Convention (ARCHITECTURE invariant 3)
-------------------------------------
Every array here is ``[B, L]`` in the teacher-forcing layout of :mod:`strop.rl.rollout`:
column ``t`` is about token ``x_t``, and ``mask[b, t] = 1`` means ``x_t`` is a response
token. Emitting ``x_t`` is one action of the token-level MDP:

- the **state** before it is the prefix ``s_t = x_<t``;
- the **action** is ``x_t``, sampled from the logits at column ``t - 1`` (the last hidden
  state of ``x_<t``), so ``logprobs[t] = log pi(x_t | x_<t)``;
- the **reward** ``rewards[t]`` is what emitting ``x_t`` earns (the sequence score on the
  last response token, minus the KL penalty on every response token when it is in the
  reward), see :func:`token_rewards`;
- the **value** ``values[t] = V(s_t)`` is the critic's estimate *before* emitting ``x_t``.

A causal critic's value head applied to the hidden state at column ``j`` has seen
``x_0 .. x_j``, so its raw output ``raw[j]`` estimates ``V(x_<=j) = V(s_{j+1})``. The state
``s_t = x_<t`` therefore has its value at column ``t - 1``: the same hidden state that
produced the logits for ``x_t``. :func:`shift_values` moves it there
(``values[:, t] = raw[:, t - 1]``, ``values[:, 0] = 0``). With that shift, ``values[t]``
and ``logprobs[t]`` are read from one hidden state, and the one-step TD error of action
``x_t`` is ``r_t + gamma * values[t'] - values[t]`` with ``t'`` the next response column.
After a row's last response token the episode is over: its next value is 0, so ``raw`` at
the last response column (the value of the finished sequence) is never used.

GAE runs right to left over response columns only ("carry-forward masking"): a column
with ``mask = 0`` passes the running ``next_value`` and advantage through unchanged and
gets advantage 0. So prompts (left padding included), right padding after an EOS, and
any holes inside a response (e.g. tool output not sampled by the policy) take no part.

Numbers are computed in float64 and returned in the inputs' floating dtype (at least
float32). ``docs/ppo.md`` has a worked example.
"""

from __future__ import annotations

import numpy as np

WHITEN_EPS = 1e-8


def _out_dtype(*arrays: np.ndarray) -> np.dtype:
    return np.result_type(*[np.asarray(a).dtype for a in arrays], np.float32)


def _check_2d(name: str, x: np.ndarray, shape: tuple[int, ...] | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be [B, L], got shape {x.shape}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {x.shape}, expected {shape} (the mask's)")


def shift_values(raw, xp=np):
    """The value head's per-column outputs ``raw [B, L, ...]`` -> ``values [B, L, ...]`` with
    ``values[:, t] = V(x_<t) = raw[:, t - 1]`` and ``values[:, 0] = 0``; ``raw`` is an array
    of the array module ``xp`` (``numpy``, ``jax.numpy`` or ``torch``: the backends pass
    theirs), differentiable there.

    ``raw[:, j]`` comes from the hidden state at column ``j``, which has read ``x_<=j``;
    the state before emitting ``x_t`` is ``x_<t``, whose last hidden state is at
    ``t - 1`` (the one whose logits predict ``x_t``). See the module docstring.
    """
    if raw.ndim < 2:
        raise ValueError(f"raw values must be [B, L, ...], got shape {tuple(raw.shape)}")
    return xp.concatenate([xp.zeros_like(raw[:, :1]), raw[:, :-1]], 1)


def last_response_index(mask: np.ndarray) -> np.ndarray:
    """``[B]`` column of each row's last response token; ValueError on a row without one."""
    mask = np.asarray(mask) > 0
    _check_2d("mask", mask)
    empty = ~mask.any(axis=1)
    if empty.any():
        rows = np.flatnonzero(empty).tolist()
        raise ValueError(f"rows {rows} have no response token (mask is all 0)")
    return mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)


def token_rewards(
    scores: np.ndarray,
    mask: np.ndarray,
    kl: np.ndarray | None = None,
    kl_coef: float = 0.0,
) -> np.ndarray:
    """Per-token rewards ``[B, L]``: ``scores [B]`` (one per sequence) on each row's last
    response token, minus ``kl_coef * kl`` on every response token when a per-token KL
    ``[B, L]`` is given (the KL-in-reward form). 0 on non-response columns.

    Raises ValueError for a row with no response token (its score would be lost).
    """
    mask = np.asarray(mask)
    scores = np.asarray(scores)
    _check_2d("mask", mask)
    if scores.shape != (mask.shape[0],):
        raise ValueError(f"scores has shape {scores.shape}, expected ({mask.shape[0]},)")
    dtype = _out_dtype(scores) if kl is None else _out_dtype(scores, kl)
    on = (mask > 0).astype(np.float64)
    rewards = np.zeros(mask.shape, dtype=np.float64)
    rewards[np.arange(mask.shape[0]), last_response_index(mask)] = scores
    if kl is not None:
        kl = np.asarray(kl, dtype=np.float64)
        _check_2d("kl", kl, mask.shape)
        rewards -= kl_coef * kl * on
    return rewards.astype(dtype)


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """GAE advantages ``[B, L]`` over response columns, 0 elsewhere.

    From ``t = L - 1`` down to 0, on a response column::

        delta_t = r_t + gamma * next_value - v_t
        A_t     = delta_t + gamma * lam * A_next
        next_value, A_next = v_t, A_t

    and on a masked column ``next_value`` and ``A_next`` are carried through unchanged and
    ``A_t = 0``. Both start at 0 (the episode ends after the last response token).
    ``values`` follows the convention of :func:`shift_values`.
    """
    mask = np.asarray(mask)
    _check_2d("mask", mask)
    r = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    _check_2d("rewards", r, mask.shape)
    _check_2d("values", v, mask.shape)
    on = mask > 0
    advantages = np.zeros(mask.shape, dtype=np.float64)
    next_value = np.zeros(mask.shape[0])
    last = np.zeros(mask.shape[0])
    for t in range(mask.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * last
        last = np.where(on[:, t], step, last)
        next_value = np.where(on[:, t], v[:, t], next_value)
        advantages[:, t] = np.where(on[:, t], step, 0.0)
    return advantages.astype(_out_dtype(rewards, values))


def advantages_and_returns(
    rewards: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    gamma: float,
    lam: float,
    lam_returns: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, returns)``, both ``[B, L]`` and 0 off response columns.

    ``advantages = gae(..., lam)`` (the policy's); ``returns = gae(..., lam_returns) +
    values`` on response columns (the critic's targets), ``lam_returns=None`` meaning
    ``lam``. With ``lam_returns = 1`` the returns are the discounted reward-to-go.
    Whitening (``ppo.whiten_advantages``) is left to the caller: :func:`masked_whiten`.
    """
    advantages = gae(rewards, values, mask, gamma, lam)
    lam_r = lam if lam_returns is None else lam_returns
    critic_adv = advantages if lam_r == lam else gae(rewards, values, mask, gamma, lam_r)
    on = np.asarray(mask) > 0
    returns = np.where(on, critic_adv.astype(np.float64) + np.asarray(values, np.float64), 0.0)
    return advantages, returns.astype(advantages.dtype)


def masked_mean(x: np.ndarray, mask: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """Mean of ``x`` over entries with ``mask = 1`` (whole array, or along ``axis``).

    0 where there is no such entry (not NaN), like the losses' ``token_mean``.
    """
    x = np.asarray(x, dtype=np.float64)
    m = (np.asarray(mask) > 0).astype(np.float64)
    total = np.sum(np.where(m > 0, x, 0.0), axis=axis)
    count = np.sum(m, axis=axis)
    mean = total / np.maximum(count, 1.0)
    return float(mean) if axis is None else mean


def masked_whiten(x: np.ndarray, mask: np.ndarray, shift_mean: bool = True) -> np.ndarray:
    """``(x - mean) / sqrt(var + 1e-8)`` with mean and (biased, ``unbiased=False``)
    variance over the ``mask = 1`` entries of the whole batch; with ``shift_mean=False``
    the mean is added back (only the scale changes). Masked entries come out 0.

    Raises ValueError when the mask selects nothing.
    """
    on = np.asarray(mask) > 0
    if not on.any():
        raise ValueError("masked_whiten: the mask selects no entry")
    x64 = np.asarray(x, dtype=np.float64)
    mean = masked_mean(x64, on)
    var = masked_mean((x64 - mean) ** 2, on)
    whitened = (x64 - mean) / np.sqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return np.where(on, whitened, 0.0).astype(_out_dtype(x))
