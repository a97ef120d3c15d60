"""The registered policy losses besides ``ppo`` (``ppo.policy_loss``: gspo, ...) equal
independent float64 numpy ports of verl's / TRL's (``tests/losses_reference.py``): the core's
entry over numpy float64 ops at 1e-9, each backend's per-token loss and its gradient at
1e-5; and a sequence-level loss gives the same numbers on packed rows (several rollouts in
one row, ``strop.batch.packing``) as on the rows unpacked.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from strop.backends.jax import losses as jax_losses
from strop.backends.torch import losses as torch_losses
from strop.batch import packing
from strop.config import load_config
from strop.objectives.losses import POLICY_LOSSES, weighted_sum
from strop.objectives.micro import policy_micro_loss
from strop.objectives.ppo import PolicyObjective, aggregation_weights
from tests import losses_reference as ref
from tests.parity.test_ppo_losses import random_case

OPS = {"jax": jax_losses.OPS, "torch": torch_losses.OPS}
CLIPS = [(0.2, 0.2), (0.2, 0.28)]


def objective(name: str, clip_low: float = 0.2, clip_high: float = 0.2) -> PolicyObjective:
    return PolicyObjective(
        temperature=1.0, clip_low=clip_low, clip_high=clip_high, dual_clip=None,
        kl_in_loss=False, kl_coef=0.0, kl_estimator="k1", entropy_coef=0.0, policy_loss=name,
        sapo_temperature_pos=1.0 + clip_low, sapo_temperature_neg=1.0 + 2 * clip_high,
    )  # fmt: skip


def inputs(case, convert, logprobs=None):
    """The entry's inputs as :func:`strop.objectives.micro.policy_micro_loss` makes them,
    one rollout per row (segment 1 on every token)."""
    on = convert(case["mask"]) > 0
    sel = lambda x: torch.where(on, x, 0.0) if isinstance(on, torch.Tensor) else on * x  # noqa: E731
    return {
        "logprobs": sel(convert(case["logprobs"]) if logprobs is None else logprobs),
        "old_logprobs": sel(convert(case["old_logprobs"])),
        "advantages": sel(convert(case["advantages"])),
        "on": on,
        "segments": convert(np.ones(case["mask"].shape, np.int32)),
    }


NAMES = ["gspo", "cispo", "sapo"]


def reference(name, case, clip_low, clip_high):
    """The port's ``(per_token, grad, stats)``; sapo's temperatures are ``objective``'s."""
    args = (case["logprobs"], case["old_logprobs"], case["advantages"], case["mask"])
    if name == "sapo":
        return ref.sapo(*args, 1.0 + clip_low, 1.0 + 2 * clip_high)
    return {"gspo": ref.gspo, "cispo": ref.cispo}[name](*args, clip_low, clip_high)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("clips", CLIPS)
@pytest.mark.parametrize("name", NAMES)
def test_the_core_entry_in_float64_is_the_port(name, clips, seed):
    case = {k: np.asarray(v, np.float64) for k, v in random_case(seed).items()}
    per_token, _, stats = reference(name, case, *clips)
    goal = objective(name, *clips)
    got, terms = POLICY_LOSSES[name].fn(ref.NUMPY_OPS, inputs(case, np.asarray), goal)
    np.testing.assert_allclose(got * case["mask"], per_token, rtol=1e-9, atol=1e-9)
    for key, value in stats.items():
        assert 0 < value.sum() < case["mask"].sum()  # the clip is in play, not everywhere
        np.testing.assert_allclose(terms[key] * case["mask"], value, atol=0)


DEFINED_WITH = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "cispo": "token-mean"}
"""How verl and TRL aggregate each loss: GSPO and SAPO per sequence (TRL's ``loss_type`` grpo
and sapo, verl's GSPO recipe), CISPO over all tokens (TRL's token count)."""


@pytest.mark.parametrize("name", NAMES)
def test_the_default_aggregation_is_the_one_the_loss_was_defined_with(name):
    """``ppo.policy_loss=gspo`` or ``sapo`` with ``ppo.loss_aggregation`` unset was a token
    mean, neither verl's loss nor TRL's; each loss now gives the references' number, the
    recipe's settings (clips, SAPO's temperatures) read from the config."""
    config = load_config("ppo-lora-tiny", [f"ppo.policy_loss={name}", "ppo.dual_clip=null"])
    ppo = config.ppo
    case = {k: np.asarray(v, np.float64) for k, v in random_case(0).items()}
    args = (case["logprobs"], case["old_logprobs"], case["advantages"], case["mask"])
    temperatures = (ppo.sapo_temperature_pos, ppo.sapo_temperature_neg)
    per_token, _, _ = (
        ref.sapo(*args, *temperatures)
        if name == "sapo"
        else {"gspo": ref.gspo, "cispo": ref.cispo}[name](*args, ppo.clip_low, ppo.clip_high)
    )
    expected = ref.verl_agg_loss(per_token, case["mask"], DEFINED_WITH[name])
    goal = PolicyObjective.from_config(config)
    got, _ = POLICY_LOSSES[name].fn(ref.NUMPY_OPS, inputs(case, np.asarray), goal)
    weights = aggregation_weights(case["mask"], ppo.loss_aggregation)
    assert float((got * weights).sum()) == pytest.approx(expected, rel=1e-6)  # float32 weights


def _to_jax(x):
    return jnp.asarray(x)


def _to_torch(x):
    return torch.from_numpy(np.asarray(x))


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("clips", CLIPS)
@pytest.mark.parametrize("name", NAMES)
def test_each_backend_gives_the_port_s_loss_and_gradient(impl, name, clips, seed):
    case = random_case(seed)
    per_token, grad, _ = reference(
        name, {k: np.asarray(v, np.float64) for k, v in case.items()}, *clips
    )
    weights = aggregation_weights(case["mask"], "sequence_mean")
    entry, ops, goal = POLICY_LOSSES[name], OPS[impl], objective(name, *clips)
    if impl == "jax":
        w = jnp.asarray(weights)

        def loss(lp):
            out, _ = entry.fn(ops, inputs(case, _to_jax, lp), goal)
            return weighted_sum(ops, out, w), out

        (_, out), got_grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(case["logprobs"]))
    else:
        lp = torch.from_numpy(case["logprobs"]).requires_grad_(True)
        out, _ = entry.fn(ops, inputs(case, _to_torch, lp), goal)
        weighted_sum(ops, out, torch.from_numpy(weights)).backward()
        out, got_grad = out.detach(), lp.grad
    np.testing.assert_allclose(np.asarray(out) * case["mask"], per_token, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_grad), grad * weights, rtol=1e-5, atol=1e-6)


def rollouts(seed: int, rows: int = 12, width: int = 12, copies: int = 3):
    """Left-padded prompts (``copies`` rollouts per prompt), responses, right padding, and
    random per-token arrays; the advantages are one per row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 50, (rows, width)).astype(np.int32)
    attention = np.zeros_like(ids)
    response = np.zeros(ids.shape, np.float32)
    for row in range(rows):
        if row % copies == 0:
            prompt = int(rng.integers(1, 7))
        else:
            ids[row, :6] = ids[row - 1, :6]
        length = int(rng.integers(1, 7))
        attention[row, 6 - prompt : 6 + length] = 1
        response[row, 6 : 6 + length] = 1
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    old = -rng.exponential(1.5, ids.shape)
    return {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "response_mask": response,
        "loss_weights": aggregation_weights(response, "sequence_mean"),
        "old_logprobs": f32(old),
        "logprobs": f32(old + rng.normal(scale=0.4, size=ids.shape)),
        "advantages": f32(np.repeat(rng.normal(size=(rows, 1)), width, axis=1)),
    }


def _micro_loss(impl, micro, goal):
    """:func:`policy_micro_loss` on a backend, its ``logits`` being the log-probabilities
    themselves (``token_logprobs`` passes them through): the loss, its stats and its
    gradient with respect to them."""
    ops = dataclasses.replace(
        OPS[impl], token_logprobs=lambda lg, ids, t: lg, token_entropy=lambda lg, t: lg * 0.0
    )
    if impl == "jax":
        arrays = {k: jnp.asarray(v) for k, v in micro.items()}
        fn = lambda lp: policy_micro_loss(ops, lp, arrays, goal)  # noqa: E731
        (loss, stats), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(arrays["logprobs"])
        return float(loss), {k: float(v) for k, v in stats.items()}, np.asarray(grad)
    arrays = {k: torch.from_numpy(v) for k, v in micro.items()}
    lp = arrays["logprobs"].requires_grad_(True)
    loss, stats = policy_micro_loss(ops, lp, arrays, goal)
    loss.backward()
    return float(loss.detach()), {k: float(v) for k, v in stats.items()}, lp.grad.numpy()


@pytest.mark.parametrize("impl", ["jax", "torch"])
@pytest.mark.parametrize("share", [False, True], ids=["apart", "shared-prompts"])
@pytest.mark.parametrize("name", ["gspo"])
def test_packed_rows_give_what_the_rows_do_unpacked(impl, name, share):
    batch = rollouts(seed=0)
    plan = packing.plan(
        batch["attention_mask"], buckets=False, bin_width=2.0,
        **packing.shared_prompts(batch, share),
    )  # fmt: skip
    assert plan is not None and plan.bins < len(batch["input_ids"]) // 2  # several per row
    goal = objective(name)
    loss, stats, grad = _micro_loss(impl, batch, goal)
    packed = plan.pack({k: v for k, v in batch.items() if k != "response_mask"})
    packed_loss, packed_stats, packed_grad = _micro_loss(impl, packed, goal)
    assert 0 < stats["clipfrac"] < 1
    np.testing.assert_allclose(packed_loss, loss, rtol=1e-5, atol=1e-6)
    for key, value in stats.items():
        np.testing.assert_allclose(packed_stats[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(plan.unpack(packed_grad), grad, rtol=1e-5, atol=1e-7)
    # the segments matter: the bins' tokens taken as one rollout each give another loss
    whole = {**packed, "attention_mask": (packed["attention_mask"] > 0).astype(np.int32)}
    assert abs(_micro_loss(impl, whole, goal)[0] - loss) > 1e-4
