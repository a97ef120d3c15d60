"""What the PPO updates optimise, as plain settings both backends read, and the loss weights
that make micro-batching and data parallelism exact.

A PPO loss is an aggregate of per-token terms over a mini-batch's response tokens
(``token_mean``, ``sequence_mean`` or Dr. GRPO's ``seq_mean_token_sum_norm``, see
:func:`aggregation_weights`). All three are linear in the per-token terms, so the core
computes, once per mini-batch, weights ``w [B, L]`` with ``aggregate(x, mask, mode) ==
(x * w).sum()``. A backend then sums ``x * w`` over whatever rows it holds (a micro-batch,
a rank's shard) and the sums add up to the mini-batch loss exactly, with no division by a
local count (ARCHITECTURE invariant 9). Statistics (clip fractions, entropy, KL) use the
same weights. The per-token terms follow the conventions of :mod:`strop.objectives.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from strop.objectives.corrections import CORRECTIONS
from strop.objectives.losses import (
    CONSTANT_NORMALISED,
    Aggregation,
    KlEstimator,
    check_aggregation,
)
from strop.objectives.plugins import resolve_policy_loss

if TYPE_CHECKING:
    from strop.config import Config

WEIGHTS = "rollout_is_weights"
"""The update array a rollout correction adds (``[B, L]`` float32, 0 off the response;
:mod:`strop.rl.rollout_correction`)."""

UPDATE_COLUMNS = ("input_ids", "attention_mask", "loss_weights")
"""The arrays every update reads: tokens, attention and the loss weights."""


@dataclass(frozen=True)
class PolicyObjective:
    """The actor's loss: clipped surrogate, optional KL-to-reference term, entropy bonus.

    ``temperature`` is the rollout's: current, old and reference log-probabilities all
    come from ``logits / temperature`` (ARCHITECTURE invariant 4). ``kl_coef`` is used
    here only when the KL is a loss term (``kl_in_loss``); in the reward it is the core's.
    ``rollout_correction``: the batch carries ``rollout_is_weights`` for the loss (a
    reweighting correction; a rejecting one changes the response mask instead).
    ``policy_loss``: ``ppo.policy_loss``, a name of
    :data:`~strop.objectives.losses.POLICY_LOSSES` (the function is looked up when the
    loss is traced, so the objective stays hashable).
    Frozen and hashable: the JAX backend passes it to ``jit`` as a static argument.
    """

    temperature: float
    clip_low: float
    clip_high: float
    dual_clip: float | None
    kl_in_loss: bool
    kl_coef: float
    kl_estimator: KlEstimator
    entropy_coef: float
    rollout_correction: bool = False
    policy_loss: str = "ppo"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    @classmethod
    def from_config(cls, config: Config) -> PolicyObjective:
        ppo = config.ppo
        return cls(
            temperature=config.generation.temperature,
            clip_low=ppo.clip_low,
            clip_high=ppo.clip_high,
            dual_clip=ppo.dual_clip,
            kl_in_loss=not ppo.kl_in_reward and ppo.kl_coef > 0,
            kl_coef=ppo.kl_coef,
            kl_estimator=ppo.kl_estimator,
            entropy_coef=ppo.entropy_coef,
            rollout_correction=ppo.rollout_correction in CORRECTIONS
            and not CORRECTIONS[ppo.rollout_correction].rejects,
            policy_loss=ppo.policy_loss,
            sapo_temperature_pos=ppo.sapo_temperature_pos,
            sapo_temperature_neg=ppo.sapo_temperature_neg,
        )

    @property
    def batch_names(self) -> tuple[str, ...]:
        """The arrays an actor update reads (all made by
        :func:`strop.rl.experience.build_experience`): the reference's log-probabilities
        only with a KL term in the loss, a rollout correction's weights only with one
        (``ppo.rollout_correction``, :mod:`strop.rl.rollout_correction`)."""
        kl = ("ref_logprobs",) if self.kl_in_loss else ()
        weights = (WEIGHTS,) if self.rollout_correction else ()
        reads = tuple(r for r in resolve_policy_loss(self.policy_loss).reads if r not in kl)
        return (*UPDATE_COLUMNS, "old_logprobs", "advantages", *kl, *weights, *reads)


SHARED_CRITIC_PREFIX = "critic_"
"""With ``critic.shared_trunk`` one update trains actor and critic: the policy update's
stats carry the critic's under this prefix (``critic_loss``, ...), logged as ``critic/*``."""


@dataclass(frozen=True)
class ValueObjective:
    """The critic's loss: ``coef * 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2)``."""

    value_clip: float | None
    coef: float

    @classmethod
    def from_config(cls, config: Config) -> ValueObjective:
        return cls(value_clip=config.ppo.value_clip or None, coef=config.ppo.value_loss_coef)

    @property
    def batch_names(self) -> tuple[str, ...]:
        """The arrays a critic update reads."""
        return (*UPDATE_COLUMNS, "old_values", "returns")


def aggregation_weights(
    mask: np.ndarray, mode: Aggregation, horizon: int | None = None
) -> np.ndarray:
    """``w [B, L] float32`` with ``(x * w).sum() == aggregate(x, mask, mode, horizon)``
    for any ``x``.

    ``token_mean``: ``1 / (response tokens in the batch)`` on each response token.
    ``sequence_mean``: ``1 / (len(row) * rows with a response token)`` on each of a row's
    response tokens. ``seq_mean_token_sum_norm`` (Dr. GRPO): ``1 / (horizon * rows with a
    response token)`` on every response token. Zero off the response, and all zero for a
    batch without one.
    """
    on = (np.asarray(mask) > 0).astype(np.float64)
    if on.ndim != 2:
        raise ValueError(f"mask must be [B, L], got shape {on.shape}")
    if mode == CONSTANT_NORMALISED:
        if not horizon or horizon < 1:
            raise ValueError(f"{CONSTANT_NORMALISED} needs the horizon (max new tokens)")
        rows = max(int((on.sum(axis=1) > 0).sum()), 1)
        return (on / (horizon * rows)).astype(np.float32)
    check_aggregation(mode)
    if mode == "token_mean":
        weights = on / max(on.sum(), 1.0)
    else:
        counts = on.sum(axis=1, keepdims=True)
        rows = max(int((counts > 0).sum()), 1)
        weights = on / np.maximum(counts, 1.0) / rows
    return weights.astype(np.float32)
