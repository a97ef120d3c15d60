"""Preference optimisation (DPO and its family): the losses written once over a backend's
:class:`~strop.objectives.losses.ArrayOps`, their registry (:data:`PREFERENCE_LOSSES`), and
the objective both backends read.

A batch holds pairs: a prompt, a chosen answer and a rejected one. Per pair the losses read
arrays ``[P]``: the policy's log-probability sums of the two answers ``chosen_logps`` and
``rejected_logps`` (differentiable), the reference's ``ref_chosen_logps`` and
``ref_rejected_logps`` (no gradient; a reference-free loss reads none), and the answers'
token counts ``chosen_tokens`` and ``rejected_tokens`` (for the losses on per-token means).
With ``beta`` = b, the policy's log-ratios to the reference ``c = chosen_logps -
ref_chosen_logps``, ``r = rejected_logps - ref_rejected_logps``, and ``softplus(x) =
log(1 + e^x)`` (so ``-log sigmoid(x) = softplus(-x)``):

- ``sigmoid`` (DPO, Rafailov et al. 2023; with ``label_smoothing`` e, cDPO):
  ``(1 - e) softplus(-b (c - r)) + e softplus(b (c - r))``; policy = reference gives log 2.
- ``hinge`` (SLiC): ``max(0, 1 - b (c - r))``.
- ``ipo`` (Azar et al. 2023, eq. 17, on per-token means as TRL does it):
  ``(c / n_chosen - r / n_rejected - 1 / (2 b))^2``.
- ``simpo`` (Meng et al. 2024; no reference): with the policy's per-token means
  ``m_c = chosen_logps / n_chosen``, ``m_r`` likewise and the target margin ``gamma`` g,
  ``(1 - e) softplus(-(b (m_c - m_r) - g)) + e softplus(b (m_c - m_r) - g)``.

Statistics per pair (TRL's DPOTrainer and CPOTrainer log the same): the rewards ``b c`` and
``b r`` (SimPO: ``b m_c`` and ``b m_r``), their margin, whether the chosen one is higher
(``reward_accuracy``), and the log-probabilities the rewards are made of (sums; SimPO's
per-token means).

**Exact under micro-batching.** A micro-batch also carries ``pair_weights [P]``: ``1 / N``
for each of its pairs, ``N`` the pairs of the whole batch, and 0 for a padding pair. A loss
or statistic is ``sum_p w_p x_p`` over the pairs with a weight (the others are selected
away), so the micro-batches' and ranks' sums add up to the batch mean exactly, as the SFT and
PPO losses do it (ARCHITECTURE invariant 9). The float64 oracle the core is held to is an
independent port of TRL's formulas: ``tests/unit/test_preference_losses.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strop.objectives.losses import ArrayOps

PAIR_INPUTS = ("chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens")
"""The per-pair arrays every preference loss reads."""
REFERENCE_INPUTS = ("ref_chosen_logps", "ref_rejected_logps")
"""The reference's per-pair arrays a loss with ``reference=True`` reads too."""
STATS = (
    "dpo/loss",
    "dpo/reward_accuracy",
    "dpo/reward_margin",
    "dpo/chosen_reward",
    "dpo/rejected_reward",
    "dpo/chosen_logps",
    "dpo/rejected_logps",
)
"""The statistics of :func:`preference_loss`, each a batch mean over its pairs."""


@dataclass(frozen=True)
class PreferenceObjective:
    """What a preference update optimises: ``loss`` (a name of :data:`PREFERENCE_LOSSES`),
    ``beta`` (> 0), ``label_smoothing`` (in ``[0, 0.5)``: the assumed share of flipped
    labels, for the losses that read it) and SimPO's target margin ``gamma``. Frozen and
    hashable: the JAX backend passes it to ``jit`` as a static argument."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.0

    def __post_init__(self) -> None:
        check_preference_loss(self.loss)
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        unread = [
            name
            for name, value, default in (
                ("label_smoothing", self.label_smoothing, 0.0),
                ("gamma", self.gamma, 0.0),
            )
            if value != default and name not in PREFERENCE_LOSSES[self.loss].settings
        ]
        if unread:
            raise ValueError(
                f"the {self.loss} loss does not read {unread[0]} "
                f"(it reads {', '.join(PREFERENCE_LOSSES[self.loss].settings)})"
            )

    @property
    def needs_reference(self) -> bool:
        return PREFERENCE_LOSSES[self.loss].reference


@dataclass(frozen=True)
class PreferenceLoss:
    """A preference loss and what it reads: ``fn(ops, inputs, objective) -> (per_pair,
    chosen_score, rejected_score)``, ``[P]`` arrays: the loss of each pair and the two
    log-probabilities its rewards are ``beta`` times (before the reference's are taken
    away); ``reference``: it reads the reference's log-probabilities; ``settings``: the
    objective's fields it reads (a later config refuses the others)."""

    fn: Callable[..., tuple[Any, Any, Any]]
    reference: bool
    settings: tuple[str, ...]


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {}
"""The preference losses' registry (``dpo.loss``): a name -> :class:`PreferenceLoss`."""


def preference_loss_entry(name: str, *, reference: bool, settings: tuple[str, ...]):
    """Decorator registering a preference loss in :data:`PREFERENCE_LOSSES`."""

    def register(fn):
        PREFERENCE_LOSSES[name] = PreferenceLoss(fn, reference, settings)
        return fn

    return register


def check_preference_loss(name: str) -> None:
    if name not in PREFERENCE_LOSSES:
        raise ValueError(
            f"unknown preference loss {name!r}; expected one of {tuple(PREFERENCE_LOSSES)}"
        )


def softplus(xp, x):
    """``log(1 + e^x)`` without overflow, as ``logaddexp(x, 0)``, whose gradient is
    ``sigmoid(x)`` everywhere: ``max(x, 0) + log1p(e^-|x|)`` has the same value but a
    gradient of 0 at ``x = 0`` (``|x|``'s derivative there is 0 in JAX and torch), where
    every pair of a fresh adapter's first step is (policy = reference): no update at all."""
    return xp.logaddexp(x, xp.zeros_like(x))


def _smoothed_logistic(xp, z, label_smoothing: float):
    """``-(1 - e) log sigmoid(z) - e log sigmoid(-z)``."""
    loss = softplus(xp, -z)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * softplus(xp, z)
    return loss


def _per_token(xp, logps, tokens):
    return logps / xp.clip(tokens, 1.0, None)


@preference_loss_entry("sigmoid", reference=True, settings=("beta", "label_smoothing"))
def sigmoid(ops: ArrayOps, inputs, objective: PreferenceObjective):
    """DPO's logistic loss of ``beta`` times the margin of the log-ratios (cDPO's smoothing)."""
    c, r = _log_ratios(inputs)
    z = objective.beta * (c - r)
    return _smoothed_logistic(ops.xp, z, objective.label_smoothing), c, r


@preference_loss_entry("hinge", reference=True, settings=("beta",))
def hinge(ops: ArrayOps, inputs, objective: PreferenceObjective):
    """SLiC's hinge on ``beta`` times the margin of the log-ratios."""
    xp = ops.xp
    c, r = _log_ratios(inputs)
    gap = 1.0 - objective.beta * (c - r)
    return xp.where(gap > 0, gap, xp.zeros_like(gap)), c, r


@preference_loss_entry("ipo", reference=True, settings=("beta",))
def ipo(ops: ArrayOps, inputs, objective: PreferenceObjective):
    """IPO's squared distance of the per-token log-ratio margin to ``1 / (2 beta)``."""
    xp = ops.xp
    c, r = _log_ratios(inputs)
    margin = _per_token(xp, c, inputs["chosen_tokens"]) - _per_token(
        xp, r, inputs["rejected_tokens"]
    )
    return (margin - 0.5 / objective.beta) ** 2, c, r


@preference_loss_entry("simpo", reference=False, settings=("beta", "label_smoothing", "gamma"))
def simpo(ops: ArrayOps, inputs, objective: PreferenceObjective):
    """SimPO: the logistic loss of ``beta`` times the per-token mean margin, less ``gamma``."""
    xp = ops.xp
    c = _per_token(xp, inputs["chosen_logps"], inputs["chosen_tokens"])
    r = _per_token(xp, inputs["rejected_logps"], inputs["rejected_tokens"])
    z = objective.beta * (c - r) - objective.gamma
    return _smoothed_logistic(xp, z, objective.label_smoothing), c, r


def _log_ratios(inputs):
    return (
        inputs["chosen_logps"] - inputs["ref_chosen_logps"],
        inputs["rejected_logps"] - inputs["ref_rejected_logps"],
    )


def _pair_sum(ops: ArrayOps, per_pair, weights):
    """``sum(per_pair * weights)`` over the pairs with a weight (padding pairs selected away)."""
    weighted = per_pair * weights
    return ops.xp.where(weights > 0, weighted, ops.xp.zeros_like(weighted)).sum()


def preference_loss(
    ops: ArrayOps, inputs: dict[str, Any], pair_weights, objective: PreferenceObjective
) -> tuple[Any, dict[str, Any]]:
    """The weighted loss of a micro-batch's pairs (``inputs``: :data:`PAIR_INPUTS` and, for
    a loss with a reference, :data:`REFERENCE_INPUTS`, each ``[P]``) and its weighted
    statistics (:data:`STATS`, without gradient)."""
    entry = PREFERENCE_LOSSES[objective.loss]
    names = PAIR_INPUTS + (REFERENCE_INPUTS if entry.reference else ())
    on = pair_weights > 0
    selected = {name: ops.select(on, inputs[name]) for name in names}
    for name in REFERENCE_INPUTS if entry.reference else ():
        selected[name] = ops.stop_gradient(selected[name])
    per_pair, chosen, rejected = entry.fn(ops, selected, objective)
    chosen_reward = objective.beta * ops.stop_gradient(chosen)
    rejected_reward = objective.beta * ops.stop_gradient(rejected)
    if entry.reference:
        chosen_logps, rejected_logps = selected["chosen_logps"], selected["rejected_logps"]
    else:
        chosen_logps, rejected_logps = chosen, rejected
    loss = _pair_sum(ops, per_pair, pair_weights)
    terms = {
        "dpo/reward_accuracy": ops.indicator(chosen_reward > rejected_reward),
        "dpo/reward_margin": chosen_reward - rejected_reward,
        "dpo/chosen_reward": chosen_reward,
        "dpo/rejected_reward": rejected_reward,
        "dpo/chosen_logps": chosen_logps,
        "dpo/rejected_logps": rejected_logps,
    }
    stats = {"dpo/loss": loss}
    stats.update({name: _pair_sum(ops, term, pair_weights) for name, term in terms.items()})
    return loss, {name: ops.stop_gradient(value) for name, value in stats.items()}


def pair_logps(ops: ArrayOps, token_logps, micro: dict[str, Any]) -> tuple[Any, Any]:
    """The log-probability sums ``[P]`` of each pair's chosen and rejected answer, from a
    forward's per-token log-probabilities ``[R, W]`` over a pair layout
    (:func:`strop.batch.pairs.lay_out_pairs`: ``answer_mask``, ``chosen_masks`` and
    ``rejected_masks``). Columns off every answer are selected away first."""
    logp = ops.select(ops.on(micro["answer_mask"]), token_logps)[None]
    return (micro["chosen_masks"] * logp).sum((1, 2)), (micro["rejected_masks"] * logp).sum((1, 2))


def preference_micro_loss(
    ops: ArrayOps, logits, micro: dict[str, Any], objective: PreferenceObjective
) -> tuple[Any, dict[str, Any]]:
    """A micro-batch's weighted preference loss and statistics from the policy's logits
    over its pair layout; ``micro`` also holds ``pair_weights``, the token counts and, for
    a loss with a reference, the reference's sums (:func:`pair_logps` of its forward)."""
    token_logps = ops.token_logprobs(logits, micro["input_ids"], 1.0)
    chosen, rejected = pair_logps(ops, token_logps, micro)
    inputs = {name: micro[name] for name in PAIR_INPUTS[2:] + REFERENCE_INPUTS if name in micro}
    inputs.update(chosen_logps=chosen, rejected_logps=rejected)
    return preference_loss(ops, inputs, micro["pair_weights"], objective)
