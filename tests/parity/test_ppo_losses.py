"""PPO losses: the JAX and torch implementations equal the numpy float64 reference.

The backends compute per-token terms (the core's ``policy_terms``, ``value_terms`` over
their ``OPS``); a loss is their sum under the loss weights of
:func:`strop.objectives.ppo.aggregation_weights`, as the PPO steps sum them
(:func:`backend_policy_loss`, :func:`backend_value_loss`). Random cases feed the same
float32 inputs to all three; the reference (``tests/losses_reference.py``)
computes in float64 on them, the backends in float32, and results must agree at rtol 1e-6
/ atol 1e-6 (float32's own rounding, ~6e-8 per op, accumulated over a few hundred
tokens). Hand-computed cases check the reference itself (and, through the same helper,
both backends) for each option. Gradients of the policy loss agree between jax.grad and
torch autograd at 1e-6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from strop.backends.jax import losses as jax_losses
from strop.backends.torch import losses as torch_losses
from strop.config import load_config
from strop.objectives.corrections import correction_weights
from strop.objectives.gae import shift_values
from strop.objectives.losses import (
    explained_variance,
    kl_estimate,
    mismatch_stats,
    policy_terms,
    value_terms,
)
from strop.objectives.micro import policy_micro_loss
from strop.objectives.ppo import WEIGHTS, PolicyObjective, aggregation_weights
from strop.rl.rollout_correction import correct, first_update_metrics, mismatch_metrics
from tests import losses_reference as ref

RTOL = ATOL = 1e-6


def to_jax(x):
    """float32 numpy -> jax; a jax array (a tracer, one to differentiate) passes through."""
    return x if isinstance(x, jax.Array) else jnp.asarray(np.asarray(x, np.float32))


def to_torch(x):
    """float32 numpy -> torch; a tensor (one that requires grad) passes through."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, np.float32))


def to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().astype(np.float64)
    return np.asarray(x, np.float64)


def numpy_tree(out):
    if isinstance(out, tuple):
        return tuple(numpy_tree(o) for o in out)
    if isinstance(out, dict):
        return {k: numpy_tree(v) for k, v in out.items()}
    return to_numpy(out)


BACKENDS = {"jax": (jax_losses, to_jax), "torch": (torch_losses, to_torch)}


def weighted_sum(impl: str, per_token, mask: np.ndarray, mode: str = "token_mean"):
    """``sum(per_token * w)`` with ``w = aggregation_weights(mask, mode)`` in the backend's
    float32, as the PPO steps sum a micro-batch (``strop.objectives.losses.weighted_sum``)."""
    weights = BACKENDS[impl][1](aggregation_weights(np.asarray(mask), mode))
    return (per_token * weights).sum()


def backend_policy_loss(
    impl, logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip=None,
    aggregation="token_mean", is_weights=None,
):  # fmt: skip
    """``ref.policy_loss`` from a backend: its ``policy_terms`` summed under the loss
    weights of ``aggregation``, and the statistics under token-mean weights (the
    reference's statistics are token means whatever the aggregation). ``mask`` is numpy."""
    module, convert = BACKENDS[impl]
    arrays = [convert(a) for a in (logprobs, old_logprobs, advantages, mask)]
    weights = None if is_weights is None else convert(is_weights)
    per_token, terms = policy_terms(module.OPS, *arrays, clip_low, clip_high, dual_clip, weights)
    stats = {name: weighted_sum(impl, term, mask) for name, term in terms.items()}
    return weighted_sum(impl, per_token, mask, aggregation), stats


def backend_value_loss(
    impl, values, old_values, returns, mask, value_clip, aggregation="token_mean"
):
    """``ref.value_loss`` from a backend: its ``value_terms`` summed under the loss weights
    of ``aggregation``, ``vf_clipfrac`` under token-mean weights. ``mask`` is numpy."""
    module, convert = BACKENDS[impl]
    arrays = [convert(a) for a in (values, old_values, returns, mask)]
    per_token, clipped = value_terms(module.OPS, *arrays, value_clip)
    stats = {"vf_clipfrac": weighted_sum(impl, clipped, mask)}
    return weighted_sum(impl, per_token, mask, aggregation), stats


def backend_kl_penalty(impl, logprobs, ref_logprobs, estimator):
    """``ref.kl_penalty`` from a backend: the core's ``kl_estimate`` over its float32 arrays
    (as the update's KL term, :func:`strop.objectives.micro.policy_micro_loss`)."""
    convert = BACKENDS[impl][1]
    xp = jnp if impl == "jax" else torch
    return kl_estimate(convert(logprobs) - convert(ref_logprobs), estimator, xp)


def backend_shift_values(impl, raw):
    """The core's ``shift_values`` over a backend's float32 arrays (as its value models
    call it)."""
    return shift_values(BACKENDS[impl][1](raw), xp=jnp if impl == "jax" else torch)


LOSSES = {
    "policy_loss": backend_policy_loss,
    "value_loss": backend_value_loss,
    "kl_penalty": backend_kl_penalty,
    "shift_values": backend_shift_values,
}


def call(impl: str, name: str, *arrays, **kwargs):
    """``name(*arrays, **kwargs)`` of the reference (``impl`` "numpy") or a backend, with
    float32 array inputs, results as float64 numpy. A backend's ``policy_loss`` and
    ``value_loss`` are its per-token terms under the loss weights, its ``kl_penalty`` and
    ``shift_values`` the core's over its arrays (``LOSSES``)."""
    if impl == "numpy":
        return numpy_tree(
            getattr(ref, name)(*[np.asarray(a, np.float32) for a in arrays], **kwargs)
        )
    if name in LOSSES:
        return numpy_tree(LOSSES[name](impl, *arrays, **kwargs))
    module, convert = BACKENDS[impl]
    return numpy_tree(getattr(module, name)(*[convert(a) for a in arrays], **kwargs))


def assert_tree_close(actual, expected, rtol=RTOL, atol=ATOL):
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_tree_close(a, e, rtol, atol)
    elif isinstance(expected, dict):
        assert set(actual) == set(expected)
        for k in expected:
            assert_tree_close(actual[k], expected[k], rtol, atol)
    else:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# --- random cases: backends equal the reference -------------------------------------------


def random_case(seed: int, batch: int = 8, width: int = 24):
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, width), np.float32)
    for b in range(batch):
        start = rng.integers(1, width // 2)
        length = rng.integers(1, width - start + 1)
        mask[b, start : start + length] = 1
    mask[0] = 0  # a row with no response token at all (all tail padding)
    mask[1, :] = 0
    mask[1, 3:6] = 1  # a short response, then a long empty tail
    old = -rng.exponential(1.5, size=mask.shape)
    # log-ratios around 0: most ratios near 1, some outside [0.8, 1.2], and a fifth of the
    # tokens far off (ratios beyond the dual clip's c = 3)
    log_ratio = rng.normal(scale=0.2, size=mask.shape)
    far = rng.random(mask.shape) < 0.2
    sign = rng.choice([-1.0, 1.0], size=mask.shape)
    log_ratio[far] = (sign * rng.uniform(1.2, 2.5, size=mask.shape))[far]
    new = old + log_ratio
    ref_lp = old + rng.normal(scale=0.5, size=mask.shape)
    adv = rng.normal(size=mask.shape)  # both signs
    old_values = rng.normal(size=mask.shape)
    values = old_values + rng.normal(scale=0.4, size=mask.shape)
    returns = rng.normal(size=mask.shape)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    case = {
        "logprobs": f32(new),
        "old_logprobs": f32(old),
        "ref_logprobs": f32(ref_lp),
        "advantages": f32(adv),
        "mask": mask,
        "values": f32(values),
        "old_values": f32(old_values),
        "returns": f32(returns),
    }
    ratio = np.exp(log_ratio)[mask > 0]
    assert (ratio < 0.8).any() and (ratio > 1.2).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    return case


SEEDS = range(4)


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_reference(impl, seed, estimator):
    c = random_case(seed)
    args = (c["logprobs"], c["ref_logprobs"])
    expected = ref.kl_penalty(*args, estimator=estimator)
    assert_tree_close(call(impl, "kl_penalty", *args, estimator=estimator), expected)


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean"])
def test_weighted_sum_matches_the_reference_aggregate(impl, seed, mode):
    c = random_case(seed)
    expected = ref.aggregate(c["advantages"], c["mask"], mode)
    values = BACKENDS[impl][1](c["advantages"])
    assert_tree_close(to_numpy(weighted_sum(impl, values, c["mask"], mode)), expected)


POLICY_OPTIONS = [
    dict(clip_low=0.2, clip_high=0.2),
    dict(clip_low=0.2, clip_high=0.28),
    dict(clip_low=0.1, clip_high=0.3, dual_clip=3.0),
    dict(clip_low=0.2, clip_high=0.2, dual_clip=1.5, aggregation="sequence_mean"),
    dict(clip_low=0.2, clip_high=0.28, aggregation="sequence_mean"),
]


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("options", POLICY_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_policy_loss_matches_reference(impl, seed, options):
    c = random_case(seed)
    args = (c["logprobs"], c["old_logprobs"], c["advantages"], c["mask"])
    expected = ref.policy_loss(*args, **options)
    assert expected[1]["clipfrac"] > 0  # the clip really is in play
    if "dual_clip" in options:
        assert expected[1]["dual_clip_frac"] > 0
    assert_tree_close(call(impl, "policy_loss", *args, **options), expected)


def correction_case(seed: int, mode: str, level: str):
    """A random case and a rollout correction's weights (strop.rl.rollout_correction)
    from a sampler whose log-probabilities are the old ones plus noise."""
    c = random_case(seed)
    rng = np.random.default_rng(100 + seed)
    sampled = c["old_logprobs"] + rng.normal(scale=0.5, size=c["mask"].shape)
    bounds = (0.7, 1.5) if mode == "icepop" else (0.0, 1.5)
    weights = correction_weights(c["old_logprobs"], sampled, c["mask"], mode, level, bounds)
    return c, np.asarray(weights, np.float32), sampled.astype(np.float32)


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize(
    "mode, level, options",
    [
        ("tis", "token", POLICY_OPTIONS[0]),
        ("mis", "sequence", POLICY_OPTIONS[2]),
        ("icepop", "token", POLICY_OPTIONS[4]),
        ("tis", "geometric", POLICY_OPTIONS[3]),
    ],
)
def test_policy_loss_with_a_rollout_correction_matches_reference(impl, seed, mode, level, options):
    c, weights, _ = correction_case(seed, mode, level)
    args = (c["logprobs"], c["old_logprobs"], c["advantages"], c["mask"])
    expected = ref.policy_loss(*args, **options, is_weights=weights)
    assert expected[0] != pytest.approx(ref.policy_loss(*args, **options)[0])  # in play
    got = call(impl, "policy_loss", *args, **options, is_weights=weights)
    assert_tree_close(got, expected, rtol=1e-5, atol=1e-5)


def corrected_loss(impl, case, sampled, overrides, **options) -> float:
    """strop's policy loss under a rollout correction, end to end: the correction of the
    ``ppo-lora-tiny`` recipe with ``overrides``, applied by
    :func:`strop.rl.rollout_correction.correct` to the case, then a backend's loss over the
    update arrays it returns (its weights, or the response mask without the rejected
    tokens: the loss weights come from that mask, as the mini-batches' do)."""
    ppo = load_config("ppo-lora-tiny", list(overrides)).ppo
    arrays, _ = correct({"response_mask": case["mask"]}, case["old_logprobs"], sampled, ppo)
    args = (case["logprobs"], case["old_logprobs"], case["advantages"], arrays["response_mask"])
    loss, _ = backend_policy_loss(impl, *args, **options, is_weights=arrays.get(WEIGHTS))
    return float(to_numpy(loss))


def sampler_logprobs(case, seed: int, scale: float) -> np.ndarray:
    rng = np.random.default_rng(200 + seed)
    noise = rng.normal(scale=scale, size=case["mask"].shape)
    return (case["old_logprobs"] + noise).astype(np.float32)


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("band", [None, (0.7, 1.6)], ids=["default-band", "band"])
def test_icepop_is_openrlhfs_icepop(impl, band):
    """``ppo.rollout_correction=icepop`` equals OpenRLHF's ``icepop`` (the ratio inside
    ``[low, high]``, 0 outside; default band OpenRLHF's [0.5, 5]), not a 0/1 band."""
    c = random_case(5)
    sampled = sampler_logprobs(c, 5, scale=0.8)
    overrides = ["ppo.rollout_correction=icepop"]
    low, high = band or (0.5, 5.0)
    if band:
        overrides += [f"ppo.rollout_correction_low={low}", f"ppo.rollout_correction_high={high}"]
    options = dict(clip_low=0.2, clip_high=0.28)
    args = (c["logprobs"], c["old_logprobs"], sampled, c["advantages"], c["mask"])
    expected = ref.openrlhf_icepop_loss(*args, **options, low=low, high=high)
    ratio = np.exp(c["old_logprobs"] - sampled)[c["mask"] > 0]
    assert ((ratio < low) | (ratio > high)).any()  # the band drops some tokens
    got = corrected_loss(impl, c, sampled, overrides, **options)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize(
    "level, scale, low, high",
    [("token", 0.5, 0.6, 1.5), ("sequence", 0.12, 0.6, 1.5), ("geometric", 0.5, 0.9, 1.08)],
)
def test_reject_is_verls_rejection_sampling(impl, level, scale, low, high):
    """``ppo.rollout_correction=reject`` equals verl's ``rollout_rs`` (``token_k1``,
    ``seq_sum_k1``, ``seq_mean_k1``) followed by its PPO loss: the rejected tokens leave
    the token mean's denominator. verl's k1 band bounds the inverse ratio: strop's ``[low,
    high]`` is verl's ``f"{1/high}_{1/low}"``."""
    c = random_case(6)
    sampled = sampler_logprobs(c, 6, scale)
    overrides = [
        "ppo.rollout_correction=reject", f"ppo.rollout_correction_level={level}",
        f"ppo.rollout_correction_low={low}", f"ppo.rollout_correction_high={high}",
    ]  # fmt: skip
    options = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)  # verl's clip_ratio_c
    args = (c["logprobs"], c["old_logprobs"], sampled, c["advantages"], c["mask"])
    expected = ref.verl_rejection_loss(
        *args, 0.2, 0.28, 3.0, ref.VERL_REJECTION[level], lower=1 / high, upper=1 / low
    )
    kept = correction_weights(c["old_logprobs"], sampled, c["mask"], "reject", level, (low, high))
    on = kept[c["mask"] > 0]
    assert (on == 0).any() and (on == 1).any()  # some tokens rejected, some kept
    assert expected != pytest.approx(ref.policy_loss(*args[:2], *args[3:], **options)[0])
    got = corrected_loss(impl, c, sampled, overrides, **options)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["jax", "torch"])
def test_weights_of_one_change_nothing(impl):
    """``rollout_correction: none`` adds no array; weights of 1 would leave every number
    exactly as it is."""
    c = random_case(3)
    args = (c["logprobs"], c["old_logprobs"], c["advantages"], c["mask"])
    ones = np.ones_like(c["mask"])
    for options in POLICY_OPTIONS:
        plain = call(impl, "policy_loss", *args, **options)
        np.testing.assert_array_equal(
            call(impl, "policy_loss", *args, **options, is_weights=ones)[0], plain[0]
        )


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_mismatch_stats_match_the_monitor(impl, seed):
    """The backends' first-update sums (sampler mode: trainer minus sampler) give the
    metrics the core computes in numpy in recompute mode."""
    c, _, sampled = correction_case(seed, "tis", "token")
    module, convert = BACKENDS[impl]
    stats = mismatch_stats(
        module.OPS, convert(c["old_logprobs"]), convert(sampled), convert(c["mask"])
    )
    assert all(to_numpy(v).shape == () for v in stats.values())
    got = first_update_metrics({k: float(to_numpy(v)) for k, v in stats.items()})
    expected = mismatch_metrics(c["old_logprobs"], sampled, c["mask"])
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("value_clip", [0.2, 0.0, None])
@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean"])
def test_value_loss_matches_reference(impl, seed, value_clip, mode):
    c = random_case(seed)
    args = (c["values"], c["old_values"], c["returns"], c["mask"])
    expected = ref.value_loss(*args, value_clip=value_clip, aggregation=mode)
    if value_clip:
        assert 0 < expected[1]["vf_clipfrac"] < 1
    assert_tree_close(
        call(impl, "value_loss", *args, value_clip=value_clip, aggregation=mode), expected
    )


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_matches_reference(impl, seed):
    logits = np.random.default_rng(seed).normal(scale=3.0, size=(3, 5, 64)).astype(np.float32)
    assert_tree_close(call(impl, "entropy_from_logits", logits), ref.entropy_from_logits(logits))


@pytest.mark.parametrize("impl", ["jax", "torch"])
def test_shift_values_matches_reference(impl):
    raw = np.random.default_rng(0).normal(size=(3, 6)).astype(np.float32)
    assert_tree_close(call(impl, "shift_values", raw), shift_values(raw))


def test_backend_stats_are_0d_and_gradient_free():
    """The PPO steps' micro-batch loss is a differentiable float32 scalar, its statistics
    0-d and without gradient; the reference's are Python floats."""
    c = random_case(0)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(*c["mask"].shape, 16)).astype(np.float32)
    micro = {
        "input_ids": rng.integers(0, 16, c["mask"].shape).astype(np.int32),
        "loss_weights": aggregation_weights(c["mask"], "token_mean"),
        **{k: c[k] for k in ("old_logprobs", "advantages", "ref_logprobs")},
    }
    objective = PolicyObjective(
        temperature=1.0, clip_low=0.2, clip_high=0.2, dual_clip=2.0, kl_in_loss=True,
        kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01,
    )  # fmt: skip
    t_logits = torch.from_numpy(logits).requires_grad_(True)
    t_micro = {k: torch.from_numpy(v) for k, v in micro.items()}
    loss, stats = policy_micro_loss(torch_losses.OPS, t_logits, t_micro, objective)
    assert loss.requires_grad and loss.dtype == torch.float32 and loss.ndim == 0
    assert {"clipfrac", "approx_kl", "dual_clip_frac", "kl_loss"} <= stats.keys()
    assert all(s.ndim == 0 and not s.requires_grad for s in stats.values())
    j_micro = {k: jnp.asarray(v) for k, v in micro.items()}
    j_loss, j_stats = policy_micro_loss(jax_losses.OPS, jnp.asarray(logits), j_micro, objective)
    assert j_loss.dtype == jnp.float32 and all(s.shape == () for s in j_stats.values())

    def stats_sum(lg):
        return sum(policy_micro_loss(jax_losses.OPS, lg, j_micro, objective)[1].values())

    assert not np.asarray(jax.grad(stats_sum)(jnp.asarray(logits))).any()  # stop_gradient
    args = (c["logprobs"], c["old_logprobs"], c["advantages"], c["mask"])
    r_loss, r_stats = ref.policy_loss(*args, 0.2, 0.2, dual_clip=2.0)
    assert isinstance(r_loss, float) and all(isinstance(s, float) for s in r_stats.values())


def test_jax_losses_jit():
    c = random_case(1)
    mask = c["mask"]
    args = [to_jax(c[k]) for k in ("logprobs", "old_logprobs", "advantages")]
    fn = jax.jit(lambda *a: backend_policy_loss("jax", *a, mask, 0.2, 0.28, dual_clip=3.0))
    assert_tree_close(
        numpy_tree(fn(*args)), ref.policy_loss(*map(np.asarray, args), mask, 0.2, 0.28, 3.0)
    )


# --- gradients: jax.grad equals torch autograd ---------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
        dict(clip_low=0.2, clip_high=0.2, aggregation="sequence_mean"),
    ],
    ids=["token_mean-dual", "sequence_mean"],
)
def test_policy_loss_gradients_agree(options):
    c = random_case(2)
    old, adv, mask = c["old_logprobs"], c["advantages"], c["mask"]

    def jax_loss(logprobs):
        return backend_policy_loss("jax", logprobs, old, adv, mask, **options)[0]

    j_grad = np.asarray(jax.grad(jax_loss)(to_jax(c["logprobs"])), np.float64)

    logprobs = to_torch(c["logprobs"]).requires_grad_(True)
    t_loss, _ = backend_policy_loss("torch", logprobs, old, adv, mask, **options)
    t_loss.backward()
    t_grad = logprobs.grad.numpy().astype(np.float64)

    assert np.abs(j_grad).max() > 1e-3  # some tokens do get a gradient
    assert np.all(j_grad[mask == 0] == 0)  # padding gets none
    np.testing.assert_allclose(j_grad, t_grad, rtol=1e-6, atol=1e-6)
    # and both equal the analytic gradient: d/dlogp (-A * ratio) on unclipped tokens
    ratio = np.exp(c["logprobs"].astype(np.float64) - old)
    live = (mask > 0) & (j_grad != 0)
    if options.get("aggregation", "token_mean") == "token_mean":
        expected = -adv * ratio / mask.sum()
        np.testing.assert_allclose(j_grad[live], expected[live], rtol=1e-5, atol=1e-7)


# --- hand-computed cases (each implementation) ------------------------------------------------

ALL = ["numpy", "jax", "torch"]


@pytest.mark.parametrize("impl", ALL)
def test_asymmetric_clip(impl):
    # clip_low 0.1, clip_high 0.3: clip range [0.9, 1.3] (no ratio sits on a boundary)
    ratio = np.array([[1.5, 1.1, 0.5, 0.85, 1.5]])
    adv = np.array([[1.0, 1.0, -1.0, -1.0, -2.0]])
    mask = np.ones((1, 5))
    old = np.zeros((1, 5))
    loss, stats = call(
        impl, "policy_loss", np.log(ratio), old, adv, mask, clip_low=0.1, clip_high=0.3
    )
    # token 0: A>0, ratio 1.5 > 1.3: pg1 = -1.5, pg2 = -1.3  -> -1.3 (clipped)
    # token 1: A>0, ratio 1.1 inside:                          -1.1
    # token 2: A<0, ratio 0.5 < 0.9:  pg1 = 0.5,  pg2 = 0.9   -> 0.9 (clipped)
    # token 3: A<0, ratio 0.85 < 0.9: pg1 = 0.85, pg2 = 0.9   -> 0.9 (clipped)
    # token 4: A<0, ratio 1.5:        pg1 = 3.0,  pg2 = 2.6   -> 3.0 (not clipped)
    per_token = [-1.3, -1.1, 0.9, 0.9, 3.0]
    assert loss == pytest.approx(np.mean(per_token), rel=1e-6)
    assert stats["clipfrac"] == pytest.approx(3 / 5)
    approx_kl = np.mean(0.5 * np.log(ratio) ** 2)
    assert stats["approx_kl"] == pytest.approx(approx_kl, rel=1e-6)
    assert "dual_clip_frac" not in stats
    # symmetric 0.2 ([0.8, 1.2]): token 3's 0.85 is now inside; tokens 0 and 2 still clip
    loss, sym = call(
        impl, "policy_loss", np.log(ratio), old, adv, mask, clip_low=0.2, clip_high=0.2
    )
    assert sym["clipfrac"] == pytest.approx(2 / 5)
    assert loss == pytest.approx(np.mean([-1.2, -1.1, 0.8, 0.85, 3.0]), rel=1e-6)


@pytest.mark.parametrize("impl", ALL)
def test_dual_clip(impl):
    # clip 0.2 both ways, dual clip c = 3: for A < 0 the loss is at most -A * 3
    ratio = np.array([[5.0, 2.0, 5.0, 0.5]])
    adv = np.array([[-1.0, -1.0, 1.0, -2.0]])
    mask = np.ones((1, 4))
    loss, stats = call(
        impl,
        "policy_loss",
        np.log(ratio),
        np.zeros((1, 4)),
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=3.0,
    )
    # token 0: A=-1, ratio 5: max(5, 1.2) = 5 > 3 -> 3 (dual clip)
    # token 1: A=-1, ratio 2: max(2, 1.2) = 2 <= 3 -> 2
    # token 2: A=+1, ratio 5: max(-5, -1.2) = -1.2 (A > 0: no dual clip)
    # token 3: A=-2, ratio 0.5: max(1, 1.6) = 1.6 <= 6 -> 1.6
    assert loss == pytest.approx((3.0 + 2.0 - 1.2 + 1.6) / 4, rel=1e-6)
    assert stats["dual_clip_frac"] == pytest.approx(1 / 4)
    assert stats["clipfrac"] == pytest.approx(2 / 4)  # tokens 2 and 3
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        call(impl, "policy_loss", ratio, ratio, adv, mask, 0.2, 0.2, dual_clip=1.0)


@pytest.mark.parametrize("impl", ALL)
def test_kl_estimators(impl):
    logp = np.array([[-1.0, -2.0, -0.5, -3.0, -6.0]])
    ref_lp = np.array([[-1.5, -1.0, -0.5, -40.0, -2.0]])
    # d = logp - ref = 0.5, -1, 0, 37, -4
    expected = {
        "k1": np.array([0.5, -1.0, 0.0, 10.0, -4.0]),  # 37 bounded to 10
        "k2": np.array([0.125, 0.5, 0.0, 10.0, 8.0]),  # d^2 / 2; 684.5 bounded to 10
        # exp(-d) + d - 1: e^-0.5 - 0.5 = 0.10653, e - 2 = 0.71828, 0, 36 + e^-37 bounded
        # to 10, e^4 - 5 = 49.6 bounded to 10
        "k3": np.array([np.exp(-0.5) - 0.5, np.e - 2.0, 0.0, 10.0, 10.0]),
    }
    for estimator, values in expected.items():
        out = call(impl, "kl_penalty", logp, ref_lp, estimator=estimator)
        np.testing.assert_allclose(out[0], values, rtol=1e-6, atol=1e-6)
    # the audit's case: a log-ratio of -15 gave k3 = e^15 - 16 = 3.3e6 for one token
    out = call(impl, "kl_penalty", np.array([[-15.0]]), np.array([[0.0]]), estimator="k3")
    np.testing.assert_array_equal(out, [[ref.KL_VALUE_LIMIT]])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        call(impl, "kl_penalty", logp, ref_lp, estimator="k4")


# log-ratios d = logprobs - ref_logprobs from absurd to ordinary, none on a bound's edge
EXTREME_LOG_RATIOS = np.array([[
    -1e4, -60.0, -25.0, -15.0, -10.5, -3.0, -2.0, -1.0, -0.25, 0.0,
    0.25, 1.0, 4.4, 4.5, 9.5, 10.5, 15.0, 25.0, 60.0, 1e4,
]])  # fmt: skip


def bounded_kl(d: np.ndarray, estimator: str) -> np.ndarray:
    """The KL value written out: the estimator on d (clamped to [-20, 20] before exp),
    then bounded to [-10, 10]."""
    if estimator == "k1":
        value = d
    elif estimator == "k2":
        value = 0.5 * d * d
    else:
        c = np.clip(d, -20.0, 20.0)
        value = np.exp(-c) + c - 1.0
    return np.clip(value, -10.0, 10.0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl_is_bounded_at_extreme_log_ratios(estimator):
    assert ref.KL_VALUE_LIMIT == 10.0
    d = EXTREME_LOG_RATIOS
    for shift in (0.0, -30.0):  # the bound is on the value, whatever the log-probs are
        out = ref.kl_penalty(d + shift, np.full_like(d, shift), estimator)
        np.testing.assert_allclose(out, bounded_kl(d, estimator), rtol=1e-12, atol=1e-9)
        assert np.abs(out).max() <= 10.0
    # inside the bound nothing changes
    x = d[np.abs(d) <= 4.4]
    raw = {"k1": x, "k2": 0.5 * x * x, "k3": np.exp(-x) + x - 1.0}[estimator]
    inside = np.abs(raw) < 10.0
    assert inside.sum() >= 7
    out = ref.kl_penalty(x, np.zeros_like(x), estimator)
    np.testing.assert_allclose(out[inside], raw[inside], rtol=1e-12)


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_backend_kl_equals_the_reference_at_extreme_log_ratios(impl, estimator):
    d = EXTREME_LOG_RATIOS.astype(np.float32)
    logp, ref_lp = d - 1.0, np.full_like(d, -1.0)
    expected = ref.kl_penalty(logp, ref_lp, estimator)
    assert_tree_close(call(impl, "kl_penalty", logp, ref_lp, estimator=estimator), expected)
    # the gradient is the estimator's inside the bound and 0 where the bound is in force
    x = np.clip(d.astype(np.float64), -20.0, 20.0)
    slope = {"k1": np.ones_like(x), "k2": x, "k3": 1.0 - np.exp(-x)}[estimator]
    slope = np.where(np.abs(bounded_kl(x, estimator)) < 10.0, slope, 0.0)
    slope = np.where(np.abs(d) < 20.0, slope, 0.0)
    if impl == "jax":
        grad = jax.grad(lambda lp: backend_kl_penalty("jax", lp, ref_lp, estimator).sum())
        got = np.asarray(grad(to_jax(logp)), np.float64)
    else:
        lp = to_torch(logp).requires_grad_(True)
        backend_kl_penalty("torch", lp, ref_lp, estimator).sum().backward()
        got = lp.grad.numpy().astype(np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, slope, rtol=1e-5, atol=1e-6)


def aggregate(impl: str, values, mask, mode: str) -> float:
    """The reference's ``aggregate``, or a backend's weighted sum under the loss weights."""
    if impl == "numpy":
        return ref.aggregate(values, mask, mode)
    return float(to_numpy(weighted_sum(impl, BACKENDS[impl][1](values), mask, mode)))


@pytest.mark.parametrize("impl", ALL)
def test_aggregations(impl):
    values = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # token_mean: (1 + 2 + 3 + 4) / 4; sequence_mean: (mean(1, 2, 3) + 4) / 2, row 2 skipped
    assert aggregate(impl, values, mask, "token_mean") == pytest.approx(2.5)
    assert aggregate(impl, values, mask, "sequence_mean") == pytest.approx(3.0)
    empty = np.zeros_like(mask)
    for mode in ("token_mean", "sequence_mean"):
        assert aggregate(impl, values, empty, mode) == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(impl, values, mask, "sum")
    # the policy loss aggregates its per-token terms the same way
    adv = -values  # ratio 1, nothing clipped: per-token loss = A... negated twice = values
    zeros = np.zeros_like(values)
    for mode, expected in (("token_mean", 2.5), ("sequence_mean", 3.0)):
        loss, _ = call(impl, "policy_loss", zeros, zeros, adv, mask, 0.2, 0.2, aggregation=mode)
        assert loss == pytest.approx(expected)


@pytest.mark.parametrize("impl", ALL)
def test_value_clipping(impl):
    old = np.array([[1.0, 1.0, 1.0, 1.0]])
    new = np.array([[1.5, 1.5, 0.9, 0.0]])
    ret = np.array([[2.0, 0.0, 0.0, 1.0]])
    mask = np.ones((1, 4))
    loss, stats = call(impl, "value_loss", new, old, ret, mask, value_clip=0.2)
    # clip(V) to [0.8, 1.2]: 1.2, 1.2, 0.9, 0.8
    # token 0: max((1.5-2)^2, (1.2-2)^2) = max(0.25, 0.64) = 0.64 (clipped term wins)
    # token 1: max(2.25, 1.44) = 2.25
    # token 2: inside: 0.81
    # token 3: max(1.0, 0.04) = 1.0
    assert loss == pytest.approx(0.5 * (0.64 + 2.25 + 0.81 + 1.0) / 4, rel=1e-6)
    assert stats["vf_clipfrac"] == pytest.approx(1 / 4)
    # value_clip 0 (as in the config) and None: no clipping, plain 0.5 * (V - R)^2
    for off in (0.0, None):
        loss, stats = call(impl, "value_loss", new, old, ret, mask, value_clip=off)
        assert loss == pytest.approx(0.5 * (0.25 + 2.25 + 0.81 + 1.0) / 4, rel=1e-6)
        assert stats["vf_clipfrac"] == 0.0


@pytest.mark.parametrize("impl", ALL)
def test_entropy(impl):
    logits = np.array(
        [[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [np.log(3.0), 0.0, -50, -50]]]
    )
    # uniform over 4: log 4; one-hot: 0; p = (3/4, 1/4, ~0, ~0): -(3/4 log 3/4 + 1/4 log 1/4)
    h = -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    out = call(impl, "entropy_from_logits", logits)
    np.testing.assert_allclose(out, [[np.log(4.0), 0.0, h]], rtol=1e-6, atol=1e-6)


def test_explained_variance():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    returns = np.array([[1.0, 2.0, 3.0, 50.0], [4.0, 50.0, 50.0, 50.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    mean = np.full_like(returns, 2.5)
    assert explained_variance(mean, returns, mask) == pytest.approx(0.0)
    # V = R + (1, -1, 1, -1): var(R - V) = 1, var(R) = 1.25
    values = returns + np.array([[1.0, -1.0, 1.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    assert explained_variance(values, returns, mask) == pytest.approx(1 - 1 / 1.25)
    assert np.isnan(explained_variance(returns, np.ones_like(returns), mask))
