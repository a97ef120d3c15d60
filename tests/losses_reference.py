"""PPO losses in numpy float64: the reference the backends' losses are tested against.

``strop.backends.jax.losses`` and ``strop.backends.torch.losses`` compute the per-token
terms (``policy_terms``, ``value_terms``, ``kl_penalty``, ``entropy_from_logits``) in float32,
differentiably; the PPO steps sum them under the loss weights of
:func:`strop.objectives.ppo.aggregation_weights`. This module computes the same losses
directly, in float64: ``aggregate`` (``token_mean``, ``sequence_mean``, Dr. GRPO's
``seq_mean_token_sum_norm``), ``policy_loss``, ``value_loss``, ``entropy_from_logits``.
``kl_penalty`` and ``explained_variance`` are the core's own numpy functions
(:mod:`strop.objectives.losses`, which also states the conventions all of them follow), re-exported.
Statistics are token means over response tokens, whatever the loss's aggregation.
"""

from __future__ import annotations

import numpy as np

from strop.objectives.losses import (
    CONSTANT_NORMALISED,
    KL_VALUE_LIMIT,
    LOG_RATIO_LIMIT,
    Aggregation,
    ArrayOps,
    check_aggregation,
    check_dual_clip,
    explained_variance,
    kl_penalty,
)

__all__ = [
    "KL_VALUE_LIMIT",
    "aggregate",
    "entropy_from_logits",
    "explained_variance",
    "kl_penalty",
    "policy_loss",
    "value_loss",
]


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _on(mask) -> np.ndarray:
    return np.asarray(mask) > 0


def _select(on: np.ndarray, x) -> np.ndarray:
    """``x`` (float64) where ``on``, else 0: nothing is computed on masked columns."""
    return np.where(on, _f64(x), 0.0)


def aggregate(
    values: np.ndarray, mask: np.ndarray, mode: Aggregation, horizon: int | None = None
) -> float:
    """Reduce per-token ``values [B, L]`` over response tokens to a scalar.

    ``token_mean``: ``sum(values * mask) / sum(mask)`` over the whole batch (every token
    weighs the same). ``sequence_mean``: the mean, over rows with at least one response
    token, of each row's token mean (every sequence weighs the same).
    ``seq_mean_token_sum_norm`` (Dr. GRPO): each such row's token *sum* divided by the
    constant ``horizon`` (``generation.max_new_tokens``), averaged over the rows, so no
    length normalisation favours short or long responses. 0 when there is no response
    token at all.
    """
    on = _on(mask)
    x = np.where(on, _f64(values), 0.0)
    if mode == CONSTANT_NORMALISED:
        if not horizon or horizon < 1:
            raise ValueError(f"{CONSTANT_NORMALISED} needs the horizon (max new tokens)")
        rows = int((on.sum(axis=1) > 0).sum())
        return float(x.sum() / horizon / max(rows, 1))
    check_aggregation(mode)
    if mode == "token_mean":
        return float(x.sum() / max(on.sum(), 1))
    counts = on.sum(axis=1)
    row_means = x.sum(axis=1) / np.maximum(counts, 1)
    has = counts > 0
    return float(np.where(has, row_means, 0.0).sum() / max(has.sum(), 1))


def _token_mean(values: np.ndarray, mask: np.ndarray) -> float:
    return aggregate(values, mask, "token_mean")


def policy_loss(
    logprobs: np.ndarray,
    old_logprobs: np.ndarray,
    advantages: np.ndarray,
    mask: np.ndarray,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token_mean",
    is_weights: np.ndarray | None = None,
) -> tuple[float, dict[str, float]]:
    """Clipped-surrogate PPO loss (to minimise) and its statistics.

    ``ratio = exp(logprobs - old_logprobs)`` (log-ratio clamped to ``[-20, 20]``);
    ``pg1 = -A * ratio``; ``pg2 = -A * clip(ratio, 1 - clip_low, 1 + clip_high)``;
    ``loss_t = max(pg1, pg2)``, and with a dual clip ``c > 1``, for ``A < 0``:
    ``loss_t = min(max(pg1, pg2), -A * c)``. With a rollout correction's ``is_weights``
    (``ppo.rollout_correction``), ``loss_t * w_t``, the tokens of weight 0 left out (their
    place in the aggregation's normaliser kept). Aggregated with ``aggregation``.

    Stats (token means over response tokens): ``clipfrac`` (``pg2 > pg1``: the clipped
    term is the one in force), ``approx_kl`` (``(logprobs - old_logprobs)^2 / 2``, the k2
    estimate of KL(old || new)), and with a dual clip ``dual_clip_frac`` (``A < 0`` and
    the ``-A * c`` bound is the one in force).
    """
    check_aggregation(aggregation)
    check_dual_clip(dual_clip)
    on = _on(mask)
    log_ratio = _select(on, logprobs) - _select(on, old_logprobs)
    ratio = np.exp(np.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    adv = _select(on, advantages)
    pg1 = -adv * ratio
    pg2 = -adv * np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = np.maximum(pg1, pg2)
    stats = {
        "clipfrac": _token_mean((pg2 > pg1).astype(np.float64), mask),
        "approx_kl": _token_mean(0.5 * log_ratio * log_ratio, mask),
    }
    per_token = clipped
    if dual_clip is not None:
        bound = -adv * dual_clip
        per_token = np.where(adv < 0, np.minimum(clipped, bound), clipped)
        stats["dual_clip_frac"] = _token_mean(((adv < 0) & (clipped > bound)).astype(float), mask)
    if is_weights is not None:
        w = _select(on, is_weights)
        per_token = np.where(w > 0, per_token * w, 0.0)
    return aggregate(per_token, mask, aggregation), stats


def entropy_from_logits(logits: np.ndarray) -> np.ndarray:
    """Entropy ``[B, L]`` of ``softmax(logits [B, L, V])`` at each column.

    Column ``j``'s logits predict ``x_{j+1}``: to put the entropy of the distribution
    ``x_t`` was drawn from in column ``t`` (the layout of the other arrays), shift it right
    by one like :func:`strop.objectives.gae.shift_values`. The entropy bonus is
    ``-entropy_coef * aggregate(entropy, mask, mode)``, added by the caller.
    """
    z = _f64(logits)
    z = z - z.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=-1, keepdims=True))
    logp = z - log_norm
    return -(np.exp(logp) * logp).sum(axis=-1)


def value_loss(
    values: np.ndarray,
    old_values: np.ndarray,
    returns: np.ndarray,
    mask: np.ndarray,
    value_clip: float | None,
    aggregation: Aggregation = "token_mean",
) -> tuple[float, dict[str, float]]:
    """Clipped critic loss and its statistics.

    ``loss_t = 0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)`` with
    ``eps = value_clip``, aggregated; ``value_clip`` 0 or None means no clipping
    (``0.5 * (V - R)^2``), as ``ppo.value_clip: 0`` documents. Stats: ``vf_clipfrac``, the
    token mean of "the clipped term is the larger one".
    """
    check_aggregation(aggregation)
    on = _on(mask)
    v, r = _select(on, values), _select(on, returns)
    unclipped = (v - r) ** 2
    if value_clip:
        old = _select(on, old_values)
        v_clipped = np.clip(v, old - value_clip, old + value_clip)
        clipped = (v_clipped - r) ** 2
        per_token = 0.5 * np.maximum(unclipped, clipped)
        frac = _token_mean((clipped > unclipped).astype(np.float64), mask)
    else:
        per_token = 0.5 * unclipped
        frac = 0.0
    return aggregate(per_token, mask, aggregation), {"vf_clipfrac": frac}


# --- the registered policy-loss variants, ported from verl / TRL ----------------------------


def _sequence_mean(x: np.ndarray, on: np.ndarray) -> np.ndarray:
    """verl's ``masked_mean(x, response_mask, axis=-1)`` per row, on each of its tokens."""
    lengths = np.maximum(on.sum(axis=-1, keepdims=True), 1.0)
    return np.broadcast_to((np.where(on, x, 0.0)).sum(axis=-1, keepdims=True) / lengths, x.shape)


def gspo(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """verl's ``compute_policy_loss_gspo`` (TRL's ``importance_sampling_level="sequence"``)
    before aggregation, one rollout per row, in float64: ``(per_token, grad, clipfrac)``.

    ``s = exp(mean over the row's response tokens of logprobs - old_logprobs)`` (verl
    clamps the log at 10 from above; strop at +-LOG_RATIO_LIMIT, never reached here), on
    each token ``s_t = sg[s] * exp(logp_t - sg[logp_t])``; ``loss_t = max(-A s_t, -A
    clip(s_t, 1 - clip_low, 1 + clip_high))``. ``grad[b, t]`` = d loss_t / d logprobs[b, t]
    (the sequence ratio carries no gradient): ``-A s`` where the unclipped term is in
    force, else 0."""
    on = _on(mask)
    log_ratio = _select(on, logprobs) - _select(on, old_logprobs)
    s = np.exp(np.clip(_sequence_mean(log_ratio, on), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    adv = _select(on, advantages)
    pg1, pg2 = -adv * s, -adv * np.clip(s, 1.0 - clip_low, 1.0 + clip_high)
    per_token = np.where(on, np.maximum(pg1, pg2), 0.0)
    grad = np.where(on & ~(pg2 > pg1), -adv * s, 0.0)
    return per_token, grad, {"clipfrac": np.where(on, pg2 > pg1, False).astype(np.float64)}


def cispo(logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """verl's ``compute_policy_loss_cispo`` (MiniMax-M1) before aggregation, in float64:
    ``(per_token, grad, stats)``. ``ratio = exp(clamp(logp - old, -20, 20))``; ``loss_t =
    -clip(ratio, 1 - clip_low, 1 + clip_high).detach() * A * logp``, so ``grad = -clip(ratio)
    * A``; ``clipfrac``: the ratio is not its clipped value."""
    on = _on(mask)
    logp = _select(on, logprobs)
    ratio = np.exp(np.clip(logp - _select(on, old_logprobs), -20.0, 20.0))
    clipped = np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    adv = _select(on, advantages)
    outside = np.where(on, ratio != clipped, False).astype(np.float64)
    return -clipped * adv * logp, np.where(on, -clipped * adv, 0.0), {"clipfrac": outside}


def sapo(logprobs, old_logprobs, advantages, mask, tau_pos, tau_neg):
    """TRL's ``loss_type="sapo"`` (``get_sapo_token_loss``) at token level, in float64:
    ``(per_token, grad, stats)``. ``r = exp(logp - old)``; ``tau = tau_pos`` where ``A > 0``
    else ``tau_neg``; ``loss_t = -A * sigmoid(tau (r - 1)) * 4 / tau``, whose derivative in
    ``logp`` is ``-A * 4 * s (1 - s) * r`` (``s`` the sigmoid)."""
    on = _on(mask)
    ratio = np.exp(_select(on, logprobs) - _select(on, old_logprobs))
    adv = _select(on, advantages)
    tau = np.where(adv > 0, tau_pos, tau_neg)
    s = 1.0 / (1.0 + np.exp(-tau * (ratio - 1.0)))
    grad = np.where(on, -adv * 4.0 * s * (1.0 - s) * ratio, 0.0)
    return np.where(on, -adv * s * 4.0 / tau, 0.0), grad, {}


def _numpy_segment_mean(x, segments, on):
    out = np.zeros(np.shape(x))
    for row in range(out.shape[0]):
        for segment in np.unique(segments[row][on[row]]):
            members = on[row] & (segments[row] == segment)
            out[row, members] = x[row, members].mean()
    return out


NUMPY_OPS = ArrayOps(
    xp=np, on=_on, select=_select, indicator=lambda b: np.asarray(b, np.float64),
    stop_gradient=lambda x: x, token_logprobs=None, token_entropy=None,
    segment_mean=_numpy_segment_mean,
)  # fmt: skip
"""strop's array ops over numpy float64 (no gradients): the core's losses run on it."""


# --- the rollout corrections, ported from OpenRLHF / verl ------------------------------------


def openrlhf_icepop_loss(
    log_probs, old_log_probs, rollout_log_probs, advantages, mask, clip_low, clip_high, low, high
) -> float:
    """OpenRLHF's ``PolicyLoss.forward`` (``policy_loss_type="ppo"``, token-level loss, no
    dual clip) with ``enable_vllm_is_correction`` and ``vllm_is_correction_type="icepop"``,
    ``vllm_is_truncated_threshold = [low, high]``, in float64: ``ratio = exp(clamp(logp -
    old, -20, 20))``, ``loss = -min(ratio A, clamp(ratio, 1 - clip_low, 1 + clip_high) A)``;
    ``is = exp(old - rollout)`` (not clamped), multiplied by ``low <= is <= high``; ``loss *
    is`` averaged over every token of ``mask`` (``masked_mean(dim=None)``: the filtered
    tokens stay in the denominator)."""
    m = np.asarray(mask, np.float64)
    lp, old, rollout, adv = (np.where(m > 0, _f64(a), 0.0) for a in (
        log_probs, old_log_probs, rollout_log_probs, advantages))  # fmt: skip
    ratio = np.exp(np.clip(lp - old, -20.0, 20.0))
    surr1 = ratio * adv
    surr2 = np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -np.minimum(surr1, surr2)
    vllm_is = np.exp(old - rollout)
    vllm_is = vllm_is * ((vllm_is >= low) & (vllm_is <= high))
    return float((vllm_is * loss * m).sum() / m.sum())


VERL_REJECTION = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
"""strop's ``ppo.rollout_correction_level`` -> verl's ``rollout_rs`` option for ``reject``."""


def verl_rejection_loss(
    log_prob, old_log_prob, rollout_log_prob, advantages, response_mask, clip_low, clip_high,
    clip_ratio_c, rollout_rs, lower, upper,
) -> float:  # fmt: skip
    """verl's rejection sampling then its PPO loss, in float64:
    ``compute_rollout_rejection_mask`` with one k1 option (``token_k1``, ``seq_sum_k1``,
    ``seq_mean_k1``) and ``rollout_rs_threshold = f"{lower}_{upper}"``, whose
    ``modified_response_mask`` replaces the batch's ``response_mask``; then
    ``compute_policy_loss_vanilla`` (its dual clip ``clip_ratio_c`` always on) and
    ``agg_loss(..., "token-mean")`` over the modified mask (the rejected tokens leave the
    denominator).

    verl's k1 statistic is ``-log r`` with ``r = exp(old - rollout)``: its ``[lower,
    upper]`` band keeps ``1/upper <= r <= 1/lower`` (sequence options: the row's sum or
    masked mean of ``-log r``, the token values clamped to +-20 first)."""
    mask = np.asarray(response_mask, np.float64)
    on = mask > 0
    lp, old, rollout, adv = (np.where(on, _f64(a), 0.0) for a in (
        log_prob, old_log_prob, rollout_log_prob, advantages))  # fmt: skip
    token_k1 = -np.clip(old - rollout, -20.0, 20.0)
    if rollout_rs == "token_k1":
        stat = token_k1
    elif rollout_rs == "seq_sum_k1":
        stat = (token_k1 * mask).sum(axis=-1, keepdims=True) + 0 * token_k1
    elif rollout_rs == "seq_mean_k1":
        mean = (token_k1 * mask).sum(axis=-1, keepdims=True) / (mask.sum(-1, keepdims=True) + 1e-8)
        stat = mean + 0 * token_k1
    else:
        raise ValueError(rollout_rs)
    keep = (stat >= np.log(lower)) & (stat <= np.log(upper))
    modified = mask * keep
    ratio = np.exp(np.clip(lp - old, -20.0, 20.0))
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_pg_losses1 = np.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = np.minimum(-adv * clip_ratio_c, clip_pg_losses1)
    pg_losses = np.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    return float((pg_losses * modified).sum() / modified.sum())


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode: str) -> float:
    """verl's ``agg_loss`` (one rank, no global counts), in float64: ``token-mean``, the
    masked sum over the mask's count; ``seq-mean-token-mean``, each row's masked mean
    (over its count + 1e-8), averaged over the rows with a token (TRL's ``loss_type`` grpo
    and sapo average the same, over every row)."""
    loss_mat, mask = _f64(loss_mat), _f64(loss_mask)
    if loss_agg_mode == "token-mean":
        return float((loss_mat * mask).sum() / mask.sum())
    if loss_agg_mode == "seq-mean-token-mean":
        counts = mask.sum(axis=-1)
        seq_losses = (loss_mat * mask).sum(axis=-1) / (counts + 1e-8)
        seq_mask = (counts > 0).astype(np.float64)
        return float((seq_losses * seq_mask).sum() / seq_mask.sum())
    raise ValueError(loss_agg_mode)
