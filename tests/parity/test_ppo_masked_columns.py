"""Masked columns cannot leak into a PPO update, on either backend.

Columns with mask 0 (prompt, padding) carry whatever the rollout left there. NaN or Inf in
them must change neither the loss nor its gradient: ``0 * NaN = NaN``, and the gradient of
``where(mask, f(x), 0)`` is NaN too when ``f(x)`` is (its cotangent is 0 * f'(x)), so each
input is selected away *before* any non-linear op. Each case runs once with finite values
in the masked columns and once with NaN, +-Inf and huge values there, and must give the same
loss, statistics and gradient, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from strop.backends.jax import losses as jax_losses
from strop.backends.torch import losses as torch_losses
from strop.objectives.micro import critic_micro_loss, policy_micro_loss
from strop.objectives.ppo import PolicyObjective, ValueObjective, aggregation_weights
from strop.objectives.roles import RolePlan
from tests import losses_reference as ref
from tests.parity.test_ppo_losses import backend_policy_loss, backend_value_loss

GARBAGE = np.array([np.nan, np.inf, -np.inf, 1e30, -3e38, np.nan, 7.0], np.float32)


def poison(x: np.ndarray, mask: np.ndarray, offset: int = 0) -> np.ndarray:
    """``x`` with NaN, +-Inf and huge values in the columns where ``mask`` is 0."""
    out = np.array(x, np.float32, copy=True)
    where = np.flatnonzero(np.asarray(mask) == 0)
    out.flat[where] = GARBAGE[(np.arange(len(where)) + offset) % len(GARBAGE)]
    return out


def layout(seed: int, batch: int = 4, width: int = 10):
    """A response mask with prompt columns, tail padding and one row without a response."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, width), np.float32)
    for row in range(batch - 1):
        start = int(rng.integers(1, width // 2))
        mask[row, start : start + int(rng.integers(1, width - start + 1))] = 1
    return rng, mask


def policy_inputs(seed: int):
    rng, mask = layout(seed)
    logprobs = -rng.exponential(1.0, mask.shape).astype(np.float32)
    return {
        "logprobs": logprobs,
        "old_logprobs": (logprobs + rng.normal(0, 0.5, mask.shape)).astype(np.float32),
        "advantages": rng.normal(size=mask.shape).astype(np.float32),
        "mask": mask,
    }


def value_inputs(seed: int):
    rng, mask = layout(seed)
    old = rng.normal(size=mask.shape).astype(np.float32)
    return {
        "values": (old + rng.normal(0, 0.4, mask.shape)).astype(np.float32),
        "old_values": old,
        "returns": rng.normal(size=mask.shape).astype(np.float32),
        "mask": mask,
    }


def value_and_grad(impl: str, fn, x: np.ndarray, *rest: np.ndarray):
    """``fn(x, *rest)`` -> (value, stats), and d value / d x, as float64 numpy."""
    if impl == "jax":
        (value, stats), grad = jax.value_and_grad(fn, has_aux=True)(
            jnp.asarray(x), *map(jnp.asarray, rest)
        )
        stats = {k: float(v) for k, v in stats.items()}
        return float(value), stats, np.asarray(grad, np.float64)
    tx = torch.from_numpy(x).requires_grad_(True)
    value, stats = fn(tx, *map(torch.from_numpy, rest))
    value.backward()
    stats = {k: float(v) for k, v in stats.items()}
    return float(value.detach()), stats, tx.grad.numpy().astype(np.float64)


def assert_same(clean, dirty):
    (c_value, c_stats, c_grad), (d_value, d_stats, d_grad) = clean, dirty
    assert np.isfinite(c_value) and np.isfinite(c_grad).all()
    assert np.isfinite(d_value), f"the loss is {d_value}"
    assert np.isfinite(d_grad).all(), f"{np.isnan(d_grad).sum()} NaN gradient entries"
    assert d_value == c_value
    assert d_stats == c_stats
    np.testing.assert_array_equal(d_grad, c_grad)


# --- the losses: each backend's per-token terms under the loss weights ---------------------


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize(
    "options",
    [dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0), dict(aggregation="sequence_mean")],
    ids=["token_mean-dual", "sequence_mean"],
)
def test_policy_loss_ignores_garbage_in_masked_columns(impl, options):
    options = {"clip_low": 0.2, "clip_high": 0.2, **options}
    c = policy_inputs(0)
    mask = c["mask"]

    def fn(logprobs, old, adv):
        return backend_policy_loss(impl, logprobs, old, adv, mask, **options)

    clean = value_and_grad(impl, fn, c["logprobs"], c["old_logprobs"], c["advantages"])
    old, adv = poison(c["old_logprobs"], mask, 1), poison(c["advantages"], mask, 2)
    # the rollout's data poisoned, then the current log-probabilities too
    assert_same(clean, value_and_grad(impl, fn, c["logprobs"], old, adv))
    assert_same(clean, value_and_grad(impl, fn, poison(c["logprobs"], mask), old, adv))
    assert np.all(clean[2][mask == 0] == 0) and np.abs(clean[2]).max() > 1e-3
    # the reference gives the same (no gradient there)
    expected = ref.policy_loss(c["logprobs"], c["old_logprobs"], c["advantages"], mask, **options)
    with np.errstate(all="raise"):  # and computes nothing on the garbage (Inf - Inf)
        for offsets in ((0, 1, 2), (1, 1, 1)):
            got = ref.policy_loss(
                *(poison(c[k], mask, o) for k, o in zip(("logprobs", "old_logprobs",
                                                         "advantages"), offsets, strict=True)),
                mask, **options,
            )  # fmt: skip
            assert got == expected


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("value_clip", [0.2, None])
def test_value_loss_ignores_garbage_in_masked_columns(impl, value_clip):
    c = value_inputs(1)
    mask = c["mask"]

    def fn(values, old, returns):
        return backend_value_loss(impl, values, old, returns, mask, value_clip)

    clean = value_and_grad(impl, fn, c["values"], c["old_values"], c["returns"])
    old, returns = poison(c["old_values"], mask, 3), poison(c["returns"], mask, 4)
    assert_same(clean, value_and_grad(impl, fn, c["values"], old, returns))
    assert_same(clean, value_and_grad(impl, fn, poison(c["values"], mask), old, returns))
    expected = ref.value_loss(c["values"], c["old_values"], c["returns"], mask, value_clip)
    with np.errstate(all="raise"):  # Inf - Inf where the same garbage meets
        for offsets in ((0, 3, 4), (1, 1, 1)):
            got = ref.value_loss(
                *(poison(c[k], mask, o) for k, o in zip(("values", "old_values", "returns"),
                                                        offsets, strict=True)),
                mask, value_clip,
            )  # fmt: skip
            assert got == expected


# --- the PPO step's micro-batch losses ------------------------------------------------------

POLICY = PolicyObjective(
    temperature=0.7, clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_in_loss=True,
    kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01,
)  # fmt: skip
CRITIC = ValueObjective(value_clip=0.2, coef=0.5)
VOCAB = 32


def micro_batch(seed: int, mode: str):
    """Logits (the differentiable input) and a policy and critic micro-batch."""
    rng, mask = layout(seed)
    logits = rng.normal(0, 2.0, (*mask.shape, VOCAB)).astype(np.float32)
    ids = rng.integers(0, VOCAB, mask.shape).astype(np.int32)
    logp = np.log(np.take_along_axis(_softmax(logits / POLICY.temperature), ids[..., None], -1))
    logp = np.pad(logp[:, :-1, 0], ((0, 0), (1, 0))).astype(np.float32)  # logp of x_t at t
    micro = {
        "input_ids": ids,
        "loss_weights": aggregation_weights(mask, mode),
        "old_logprobs": (logp + rng.normal(0, 0.4, mask.shape)).astype(np.float32),
        "advantages": rng.normal(size=mask.shape).astype(np.float32),
        "ref_logprobs": (logp + rng.normal(0, 0.6, mask.shape)).astype(np.float32),
        "old_values": rng.normal(size=mask.shape).astype(np.float32),
        "returns": rng.normal(size=mask.shape).astype(np.float32),
    }
    values = (micro["old_values"] + rng.normal(0, 0.4, mask.shape)).astype(np.float32)
    return logits, values, micro, mask


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


DATA = ("old_logprobs", "advantages", "ref_logprobs", "old_values", "returns")


def poisoned(micro: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    out = dict(micro)
    for offset, name in enumerate(DATA):
        out[name] = poison(micro[name], mask, offset)
    return out


def step_losses(impl: str, logits, values, micro):
    """(policy, critic) micro-batch losses: (loss, stats, gradient) each."""
    if impl == "jax":
        m = {k: jnp.asarray(v) for k, v in micro.items()}
        policy = lambda lg: policy_micro_loss(jax_losses.OPS, lg, m, POLICY)  # noqa: E731
        critic = lambda v: critic_micro_loss(jax_losses.OPS, v, m, CRITIC)  # noqa: E731
    else:
        m = {k: torch.from_numpy(v) for k, v in micro.items()}
        policy = lambda lg: policy_micro_loss(torch_losses.OPS, lg, m, POLICY)  # noqa: E731
        critic = lambda v: critic_micro_loss(torch_losses.OPS, v, m, CRITIC)  # noqa: E731
    return value_and_grad(impl, policy, logits), value_and_grad(impl, critic, values)


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean"])
def test_ppo_step_ignores_garbage_in_masked_columns(mode):
    """old_logprobs, advantages, ref_logprobs (KL in the loss), old_values and returns hold
    NaN/Inf where the response mask is 0: the actor's and the critic's micro-batch loss,
    stats and gradient are those of finite values there, on JAX and torch alike."""
    logits, values, micro, mask = micro_batch(2, mode)
    dirty = poisoned(micro, mask)
    results = {}
    for impl in ("jax", "torch"):
        clean_policy, clean_critic = step_losses(impl, logits, values, micro)
        dirty_policy, dirty_critic = step_losses(impl, logits, values, dirty)
        assert_same(clean_policy, dirty_policy)
        assert_same(clean_critic, dirty_critic)
        assert clean_policy[1]["kl_loss"] > 0 and clean_policy[1]["clipfrac"] > 0
        assert clean_critic[1]["vf_clipfrac"] > 0
        # masked columns get no gradient (the entropy's reaches the logits of column t - 1)
        assert np.all(clean_critic[2][mask == 0] == 0)
        results[impl] = (clean_policy, clean_critic)
    for (j_value, j_stats, j_grad), (t_value, t_stats, t_grad) in zip(
        results["jax"], results["torch"], strict=True
    ):
        assert j_value == pytest.approx(t_value, rel=1e-5, abs=1e-6)
        assert j_stats.keys() == t_stats.keys()
        for key in j_stats:
            assert j_stats[key] == pytest.approx(t_stats[key], rel=1e-5, abs=1e-6), key
        np.testing.assert_allclose(j_grad, t_grad, rtol=1e-5, atol=1e-6)


# --- a whole update, through each engine ----------------------------------------------------


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_ppo_update_ignores_garbage_in_masked_columns(tiny_model_dir, backend):
    """The jitted JAX update and torch's micro-batch loop: a mini-batch with NaN/Inf off the
    response trains the actor and the critic exactly as the finite one does (SGD, so equal
    weights after the update mean equal gradients), and no update is skipped."""
    from strop.rl.experience import build_experience, minibatches
    from tests.parity.test_ppo_backends import ENGINES, make_config, random_weights
    from tests.parity.test_ppo_backends import rollout_batch as make_rollout

    qwen2 = tiny_model_dir("qwen2")
    config = make_config(
        qwen2, "optim.name=sgd", "optim.lr=1.0", "optim.weight_decay=0.0",
        "optim.max_grad_norm=null", "optim.schedule=constant", "critic.lr=1.0",
        "ppo.kl_in_reward=false", "ppo.kl_coef=0.1", "ppo.kl_estimator=k3",
        "ppo.entropy_coef=0.01", "ppo.dual_clip=3.0", "ppo.value_clip=0.2",
        "generation.temperature=0.7",
    )  # fmt: skip
    engine = ENGINES[backend](
        config, total_updates=2, plan=RolePlan.from_config(config), checkpoints=None
    )
    start = random_weights(engine, seed=1)
    engine.set_lora_weights(**start)
    batch = make_rollout(vocab_of(qwen2))
    mask = batch["response_mask"]
    old = engine.logprobs(batch)
    old = old + np.random.default_rng(2).normal(0, 0.3, old.shape).astype(np.float32) * mask
    arrays, _ = build_experience(
        batch, np.array([1.0, 0.0, 0.5, 1.0]), old, engine.logprobs(batch, reference=True),
        engine.values(batch), config.ppo,
    )  # fmt: skip
    clean = next(minibatches(arrays, 4, "token_mean", np.random.default_rng(3)))
    dirty = poisoned(clean, clean["response_mask"])
    assert all(np.isnan(dirty[name]).any() for name in DATA)

    results = []
    for mini in (clean, dirty):
        engine.set_lora_weights(**start)
        stats = {"critic": engine.train_critic(mini, 2), "policy": engine.train_policy(mini, 2)}
        results.append((stats, engine.lora_weights()))
    (clean_stats, clean_after), (dirty_stats, dirty_after) = results
    assert clean_stats["policy"]["kl_loss"] > 0 and clean_stats["policy"]["clipfrac"] > 0
    for part in ("critic", "policy"):
        assert dirty_stats[part]["skipped"] == 0, dirty_stats[part]
        assert dirty_stats[part] == clean_stats[part], part
    for role in ("actor", "critic"):
        for path, (a, b) in clean_after[role].items():
            np.testing.assert_array_equal(dirty_after[role][path][0], a, err_msg=path)
            np.testing.assert_array_equal(dirty_after[role][path][1], b, err_msg=path)
    np.testing.assert_array_equal(dirty_after["value_head"][0], clean_after["value_head"][0])
    assert dirty_after["value_head"][1] == clean_after["value_head"][1]
    moved = max(np.abs(clean_after["actor"][p][1] - start["actor"][p][1]).max()
                for p in start["actor"])  # fmt: skip
    assert moved > 1e-3  # the update did something


def vocab_of(model_dir: str) -> int:
    from strop.io.model_spec import read_model_spec

    return read_model_spec(model_dir).vocab_size
