"""PPO losses in torch: differentiable, float32.

The per-token terms the PPO steps (:mod:`strop.backends.torch.ppo_steps`) sum under
the loss weights of :func:`strop.rl.objectives.aggregation_weights`, with the conventions
of :mod:`strop.rl.losses` (see ``docs/ppo.md`` for the formulas); tested against the numpy
float64 reference ``tests/losses_reference.py`` in ``tests/parity/test_ppo_losses.py``.
Inputs are tensors (numpy arrays are accepted and put on the CPU) and are cast to float32;
results live on the inputs' device.
"""

from __future__ import annotations

import torch

from strop.rl.losses import (
    LOG_RATIO_LIMIT,
    KlEstimator,
    check_dual_clip,
    kl_estimate,
)

F32 = torch.float32


def _f32(x) -> torch.Tensor:
    return torch.as_tensor(x).to(F32)


def _on(mask) -> torch.Tensor:
    return torch.as_tensor(mask) > 0


def _select(on: torch.Tensor, x) -> torch.Tensor:
    """``x`` (as float32) where ``on``, else 0: masked columns never reach a non-linear op,
    so NaN/Inf there reach neither the result nor its gradient."""
    x = _f32(x)
    return torch.where(on.to(x.device), x, torch.zeros_like(x))


def shift_values(raw: torch.Tensor) -> torch.Tensor:
    """``values[:, t] = raw[:, t - 1]``, ``values[:, 0] = 0``: the critic's output at column
    ``t - 1`` is ``V(x_<t)`` (see :func:`strop.rl.gae.shift_values`)."""
    raw = torch.as_tensor(raw)
    return torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)


def kl_penalty(logprobs, ref_logprobs, estimator: KlEstimator) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate ``[B, L]`` in float32: k1, k2 or k3, log-ratio
    clamped, each value bounded (:func:`strop.rl.losses.kl_estimate`)."""
    return kl_estimate(_f32(logprobs) - _f32(ref_logprobs), estimator, torch)


def policy_terms(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped-surrogate loss ``[B, L]`` and per-token statistics (``clipfrac``
    and ``dual_clip_frac`` indicators, ``approx_kl``), before any aggregation; all 0 where
    ``mask`` is 0, whatever the inputs hold there (NaN and Inf included)."""
    check_dual_clip(dual_clip)
    on = _on(mask)
    log_ratio = _select(on, logprobs) - _select(on, old_logprobs)
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    adv = _select(on, advantages)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    terms = {"clipfrac": (pg2 > pg1).to(F32), "approx_kl": 0.5 * log_ratio * log_ratio}
    if dual_clip is None:
        return clipped, terms
    bound = -adv * dual_clip
    terms["dual_clip_frac"] = ((adv < 0) & (clipped > bound)).to(F32)
    return torch.where(adv < 0, torch.minimum(clipped, bound), clipped), terms


def entropy_from_logits(logits) -> torch.Tensor:
    """Entropy ``[B, L]`` of ``softmax(logits [B, L, V])`` per column, in float32
    (column ``j`` is the distribution of ``x_{j+1}``: shift right to align)."""
    logp = torch.log_softmax(_f32(logits), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def value_terms(
    values, old_values, returns, mask, value_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`` ``[B, L]`` and the
    per-token indicator that the clipped branch won; ``value_clip`` 0/None: no clipping.
    Both are 0 where ``mask`` is 0, whatever the inputs hold there."""
    on = _on(mask)
    v, r = _select(on, values), _select(on, returns)
    unclipped = (v - r) ** 2
    if not value_clip:
        return 0.5 * unclipped, torch.zeros_like(v)
    old = _select(on, old_values)
    clipped = (torch.clamp(v, old - value_clip, old + value_clip) - r) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(F32)
