"""PPO losses in ``jax.numpy``: differentiable, float32, jit-friendly.

The per-token terms the PPO steps (:mod:`strop.backends.jax.ppo_steps`) sum under the
loss weights of :func:`strop.rl.objectives.aggregation_weights`, with the conventions of
:mod:`strop.rl.losses` (see ``docs/ppo.md`` for the formulas); tested against the numpy
float64 reference ``tests/losses_reference.py`` in ``tests/parity/test_ppo_losses.py``.
Inputs are cast to float32. The clip arguments (``dual_clip``, ``value_clip``) and
``estimator`` are static Python values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strop.rl.losses import (
    LOG_RATIO_LIMIT,
    KlEstimator,
    check_dual_clip,
    kl_estimate,
)

F32 = jnp.float32


def _f32(x) -> jax.Array:
    return jnp.asarray(x, dtype=F32)


def _on(mask) -> jax.Array:
    return jnp.asarray(mask) > 0


def _select(on: jax.Array, x) -> jax.Array:
    """``x`` (as float32) where ``on``, else 0: masked columns never reach a non-linear op,
    so NaN/Inf there reach neither the result nor its gradient."""
    return jnp.where(on, _f32(x), 0.0)


def shift_values(raw: jax.Array) -> jax.Array:
    """``values[:, t] = raw[:, t - 1]``, ``values[:, 0] = 0``: the critic's output at column
    ``t - 1`` is ``V(x_<t)`` (see :func:`strop.rl.gae.shift_values`)."""
    raw = jnp.asarray(raw)
    return jnp.concatenate([jnp.zeros_like(raw[:, :1]), raw[:, :-1]], axis=1)


def kl_penalty(logprobs, ref_logprobs, estimator: KlEstimator) -> jax.Array:
    """Per-token KL(pi || ref) estimate ``[B, L]`` in float32: k1, k2 or k3, log-ratio
    clamped, each value bounded (:func:`strop.rl.losses.kl_estimate`)."""
    return kl_estimate(_f32(logprobs) - _f32(ref_logprobs), estimator, jnp)


def policy_terms(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token clipped-surrogate loss ``[B, L]`` and per-token statistics (``clipfrac``
    and ``dual_clip_frac`` indicators, ``approx_kl``), before any aggregation; all 0 where
    ``mask`` is 0, whatever the inputs hold there (NaN and Inf included)."""
    check_dual_clip(dual_clip)
    on = _on(mask)
    log_ratio = _select(on, logprobs) - _select(on, old_logprobs)
    ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    adv = _select(on, advantages)
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = jnp.maximum(pg1, pg2)
    terms = {"clipfrac": (pg2 > pg1).astype(F32), "approx_kl": 0.5 * log_ratio * log_ratio}
    if dual_clip is None:
        return clipped, terms
    bound = -adv * dual_clip
    terms["dual_clip_frac"] = ((adv < 0) & (clipped > bound)).astype(F32)
    return jnp.where(adv < 0, jnp.minimum(clipped, bound), clipped), terms


def entropy_from_logits(logits) -> jax.Array:
    """Entropy ``[B, L]`` of ``softmax(logits [B, L, V])`` per column, in float32
    (column ``j`` is the distribution of ``x_{j+1}``: shift right to align)."""
    logp = jax.nn.log_softmax(_f32(logits), axis=-1)
    return -(jnp.exp(logp) * logp).sum(axis=-1)


def value_terms(
    values, old_values, returns, mask, value_clip: float | None
) -> tuple[jax.Array, jax.Array]:
    """Per-token ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`` ``[B, L]`` and the
    per-token indicator that the clipped branch won; ``value_clip`` 0/None: no clipping.
    Both are 0 where ``mask`` is 0, whatever the inputs hold there."""
    on = _on(mask)
    v, r = _select(on, values), _select(on, returns)
    unclipped = (v - r) ** 2
    if not value_clip:
        return 0.5 * unclipped, jnp.zeros(v.shape, F32)
    old = _select(on, old_values)
    clipped = (jnp.clip(v, old - value_clip, old + value_clip) - r) ** 2
    return 0.5 * jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(F32)
