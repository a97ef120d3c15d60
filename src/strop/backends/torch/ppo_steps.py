"""The torch backend's PPO computations: log-probabilities and the two micro-batch losses.

The same functions as :mod:`strop.backends.jax.ppo_steps`, in torch. Per-token arrays
follow :mod:`strop.rl.gae` (column ``t`` is about ``x_t``, read from column ``t - 1``;
column 0 is 0). Losses are ``sum(per_token * loss_weights)`` (see
:mod:`strop.rl.objectives`), so micro-batch and rank sums add up to the mini-batch loss.
Columns without a loss weight are selected away (``where``) before any non-linear op, never
multiplied by 0, so whatever they hold (NaN, Inf) reaches neither a loss nor a gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strop.backends.torch.losses import (
    entropy_from_logits,
    kl_penalty,
    mismatch_stats,
    policy_terms,
    value_terms,
)
from strop.rl.objectives import PolicyObjective, ValueObjective
from strop.rl.rollout_correction import WEIGHTS

Stats = dict[str, torch.Tensor]


def _shift(per_column: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]`` values about ``x_1..x_{L-1}`` -> ``[B, L]`` with column 0 = 0."""
    return F.pad(per_column, (1, 0))


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``[B, L]``: ``log softmax(logits / T)`` of ``x_t`` from the logits at ``t - 1``."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    chosen = torch.gather(logp, -1, input_ids[:, 1:, None].long())[..., 0]
    return _shift(chosen)


def _weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(per_token * weights)`` over the columns with a weight, the others selected
    away (``0 * NaN`` would be NaN)."""
    weighted = per_token * weights
    return torch.where(weights > 0, weighted, torch.zeros_like(weighted)).sum()


def _select(on: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return torch.where(on, x, torch.zeros_like(x))


def policy_micro_loss(
    logits: torch.Tensor, micro: dict[str, torch.Tensor], objective: PolicyObjective
) -> tuple[torch.Tensor, Stats]:
    """The actor's weighted loss over one micro-batch and its weighted statistics.

    Only columns with a loss weight (the response tokens) count: the data there is
    selected before any non-linear op, so NaN/Inf in the other columns of
    ``old_logprobs``, ``advantages`` or ``ref_logprobs`` change neither the loss nor its
    gradient."""
    ids, weights = micro["input_ids"], micro["loss_weights"]
    on = weights > 0
    logp = _select(on, token_logprobs(logits, ids, objective.temperature))
    per_token, terms = policy_terms(
        logp, micro["old_logprobs"], micro["advantages"], on,
        objective.clip_low, objective.clip_high, objective.dual_clip,
        micro.get(WEIGHTS),  # a rollout correction's (ppo.rollout_correction), or None
    )  # fmt: skip
    entropy = _shift(entropy_from_logits(logits[:, :-1].float() / objective.temperature))
    pg_loss = _weighted_sum(per_token, weights)
    entropy_sum = _weighted_sum(entropy, weights)
    loss = pg_loss - objective.entropy_coef * entropy_sum
    stats = {name: _weighted_sum(term, weights).detach() for name, term in terms.items()}
    mismatch = mismatch_stats(logp.detach(), micro["old_logprobs"], on)
    stats.update({name: value.detach() for name, value in mismatch.items()})
    stats["pg_loss"] = pg_loss.detach()
    stats["entropy"] = entropy_sum.detach()
    if objective.kl_in_loss:
        ref = _select(on, micro["ref_logprobs"])
        kl = _weighted_sum(kl_penalty(logp, ref, objective.kl_estimator), weights)
        stats["kl_loss"] = kl.detach()
        loss = loss + objective.kl_coef * kl
    return loss, stats


def critic_micro_loss(
    values: torch.Tensor, micro: dict[str, torch.Tensor], objective: ValueObjective
) -> tuple[torch.Tensor, Stats]:
    """The critic's weighted (scaled) loss over one micro-batch; stat ``loss`` is the
    unscaled one, plus ``vf_clipfrac`` and ``value_mean``. NaN/Inf in ``old_values`` or
    ``returns`` off the response change neither the loss nor its gradient."""
    weights = micro["loss_weights"]
    on = weights > 0
    per_token, clipped = value_terms(
        values, micro["old_values"], micro["returns"], on, objective.value_clip
    )
    loss = _weighted_sum(per_token, weights)
    stats = {
        "loss": loss.detach(),
        "vf_clipfrac": _weighted_sum(clipped, weights).detach(),
        "value_mean": _weighted_sum(values.detach(), weights),
    }
    return objective.coef * loss, stats
