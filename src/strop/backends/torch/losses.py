"""PPO losses in torch: differentiable, float32.

Same functions, arguments and semantics as the numpy reference
:mod:`strop.rl.losses_reference` (see it and ``docs/ppo.md`` for the formulas); tested
against it in ``tests/parity/test_ppo_losses.py``. Inputs are tensors (numpy arrays are
accepted and put on the CPU) and are cast to float32; results live on the inputs'
device. Statistics are detached 0-d tensors.
"""

from __future__ import annotations

import torch

from strop.rl.losses_reference import (
    KL_VALUE_LIMIT,
    LOG_RATIO_LIMIT,
    Aggregation,
    KlEstimator,
    check_aggregation,
    check_dual_clip,
    check_estimator,
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
    """Per-token KL(pi || ref) estimate ``[B, L]``: k1, k2 or k3 (log-ratio clamped before
    ``exp``), each value bounded to ``[-KL_VALUE_LIMIT, KL_VALUE_LIMIT]``."""
    check_estimator(estimator)
    d = torch.clamp(_f32(logprobs) - _f32(ref_logprobs), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.exp(-d) + d - 1.0
    return torch.clamp(kl, -KL_VALUE_LIMIT, KL_VALUE_LIMIT)


def aggregate(values, mask, mode: Aggregation) -> torch.Tensor:
    """``token_mean`` or ``sequence_mean`` of ``values [B, L]`` over response tokens."""
    check_aggregation(mode)
    values = _f32(values)
    on = _on(mask).to(values.device)
    x = torch.where(on, values, torch.zeros_like(values))
    count = on.to(F32)
    if mode == "token_mean":
        return x.sum() / count.sum().clamp(min=1.0)
    counts = count.sum(dim=1)
    row_means = x.sum(dim=1) / counts.clamp(min=1.0)
    has = counts > 0
    return torch.where(has, row_means, torch.zeros_like(row_means)).sum() / has.to(F32).sum().clamp(
        min=1.0
    )


def _stat(values, mask) -> torch.Tensor:
    return aggregate(values, mask, "token_mean").detach()


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


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-surrogate PPO loss and stats ``clipfrac``, ``approx_kl`` (and
    ``dual_clip_frac`` with a dual clip)."""
    check_aggregation(aggregation)
    per_token, terms = policy_terms(
        logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip
    )
    stats = {name: _stat(term, mask) for name, term in terms.items()}
    return aggregate(per_token, mask, aggregation), stats


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


def value_loss(
    values,
    old_values,
    returns,
    mask,
    value_clip: float | None,
    aggregation: Aggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`` and stat
    ``vf_clipfrac``; ``value_clip`` 0 or None means no clipping."""
    check_aggregation(aggregation)
    per_token, clipped = value_terms(values, old_values, returns, mask, value_clip)
    return aggregate(per_token, mask, aggregation), {"vf_clipfrac": _stat(clipped, mask)}
