"""One PPO iteration's training data, in numpy: from a scored rollout and the three forward
passes (old log-probabilities, reference log-probabilities, values) to the arrays the
backends' updates read, plus the mini-batches they are read in.

Everything is ``[B, L]`` in the teacher-forcing layout of :mod:`strop.rl.rollout`; the
token convention, GAE and whitening are :mod:`strop.objectives.gae`'s (the oracle), so only it
computes advantages and returns.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from strop.config import PpoConfig
from strop.objectives import estimators, gae
from strop.objectives.losses import explained_variance, kl_penalty
from strop.objectives.ppo import aggregation_weights


def build_experience(
    batch: dict[str, np.ndarray],
    scores: np.ndarray,
    old_logprobs: np.ndarray,
    ref_logprobs: np.ndarray | None,
    values: np.ndarray | None,
    ppo: PpoConfig,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The update's arrays and the rollout's statistics.

    Args:
      batch: ``input_ids``, ``attention_mask``, ``response_mask`` of the rollout.
      scores: ``[B]`` one reward per response (placed on its last token).
      old_logprobs, ref_logprobs, values: ``[B, L]`` from the actor, the reference and the
        critic before any update (column ``t`` about ``x_t``); ``ref_logprobs`` is ``None``
        when no KL is needed (``ppo.reference_forward`` is false), ``values`` is ``None``
        for a critic-free estimator (then ``arrays`` has no ``old_values``/``returns``,
        advantages are :mod:`strop.objectives.estimators`', not whitened again, and ``stats``
        counts ``train/equal_score_groups`` for grpo/rloo).
      ppo: the ``ppo:`` config (gamma, lambdas, KL, whitening).

    Returns:
      ``(arrays, stats)``: ``arrays`` adds ``old_logprobs``, ``ref_logprobs`` (when
      given), ``old_values``, ``advantages``, ``returns`` (float32); ``stats`` has
      ``policy/kl`` (mean KL estimate to the reference per response token, when there is
      a reference forward), ``critic/explained_var``,
      ``critic/value_mean``, ``critic/return_mean``, ``policy/advantage_std``.
    """
    mask = batch["response_mask"].astype(np.float32)
    kl = None if ref_logprobs is None else kl_penalty(old_logprobs, ref_logprobs, ppo.kl_estimator)
    in_reward = kl is not None and ppo.kl_in_reward
    if values is None:
        return _critic_free_experience(batch, scores, old_logprobs, ref_logprobs, kl, ppo)
    rewards = gae.token_rewards(
        np.asarray(scores, np.float64), mask, kl=kl if in_reward else None,
        kl_coef=ppo.kl_coef if in_reward else 0.0,
    )  # fmt: skip
    advantages, returns = gae.advantages_and_returns(
        rewards, values, mask, ppo.gamma, ppo.lam, lam_returns=ppo.lam_returns
    )
    if ppo.whiten_advantages:
        advantages = gae.masked_whiten(advantages, mask)
    arrays = {
        **batch,
        "old_logprobs": np.asarray(old_logprobs, np.float32),
        "old_values": np.asarray(values, np.float32),
        "advantages": np.asarray(advantages, np.float32),
        "returns": np.asarray(returns, np.float32),
    }
    if ref_logprobs is not None:
        arrays["ref_logprobs"] = np.asarray(ref_logprobs, np.float32)
    stats = {
        **({} if kl is None else {"policy/kl": float(gae.masked_mean(kl, mask))}),
        "critic/explained_var": explained_variance(values, returns, mask),
        "critic/value_mean": float(gae.masked_mean(values, mask)),
        "critic/return_mean": float(gae.masked_mean(returns, mask)),
    }
    return arrays, stats


def _critic_free_experience(batch, scores, old_logprobs, ref_logprobs, kl, ppo: PpoConfig):
    """``build_experience`` without a critic: advantages from :mod:`strop.objectives.estimators`."""
    mask = batch["response_mask"].astype(np.float32)
    in_reward = kl is not None and ppo.kl_in_reward
    advantages = estimators.token_advantages(
        ppo.advantage_estimator, scores, mask, group_size=ppo.num_generations_per_prompt,
        gamma=ppo.gamma, std_normalize=ppo.grpo_std_normalize,
        kl=kl if in_reward else None, kl_coef=ppo.kl_coef if in_reward else 0.0,
    )  # fmt: skip
    arrays = {
        **batch,
        "old_logprobs": np.asarray(old_logprobs, np.float32),
        "advantages": np.asarray(advantages, np.float32),
    }
    stats = {}
    if ref_logprobs is not None:
        arrays["ref_logprobs"] = np.asarray(ref_logprobs, np.float32)
        stats["policy/kl"] = float(gae.masked_mean(kl, mask))
    if estimators.ESTIMATORS[ppo.advantage_estimator].grouped:
        groups = estimators.equal_score_groups(scores, ppo.num_generations_per_prompt)
        stats["train/equal_score_groups"] = float(groups)
    return arrays, stats


def minibatches(
    arrays: dict[str, np.ndarray],
    size: int,
    aggregation: str,
    rng: np.random.Generator,
    horizon: int | None = None,
    group: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """The rows in a random order, ``size`` at a time, each mini-batch with its
    ``loss_weights`` (:func:`strop.objectives.ppo.aggregation_weights`; ``horizon``, the
    response-length budget, for ``seq_mean_token_sum_norm``). With ``group`` > 1 the
    rows come in runs of ``group`` (one prompt's rollouts, which the batch holds side by
    side) and the runs are shuffled whole: ``size`` must be a multiple of ``group``."""
    rows = len(arrays["input_ids"])
    if rows % group or size % group:
        raise ValueError(
            f"{rows} rows in mini-batches of {size} do not split into groups of {group}"
        )
    order = (rng.permutation(rows // group)[:, None] * group + np.arange(group)).reshape(-1)
    for begin in range(0, rows, size):
        index = order[begin : begin + size]
        mini = {name: value[index] for name, value in arrays.items()}
        mini["loss_weights"] = aggregation_weights(mini["response_mask"], aggregation, horizon)
        yield mini
