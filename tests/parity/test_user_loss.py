"""Your own policy loss (``ppo.policy_loss=path/to/file.py:function``): one function over
strop's ``ArrayOps``, from a user's file, trains two PPO iterations on JAX (traced inside
``jit``) and on torch to the same statistics and adapters (1e-4), with its declared needs
(the reference's log-probabilities, the rollouts' segments on packed rows) honoured.
"""

from __future__ import annotations

import numpy as np
import pytest

from strop.io.model_spec import read_model_spec
from strop.objectives.micro import policy_micro_loss
from strop.objectives.plugins import PolicyLossError
from strop.objectives.ppo import PolicyObjective, aggregation_weights
from strop.objectives.roles import RolePlan
from strop.rl.experience import build_experience, minibatches
from tests.parity.test_critic_free import ENGINES
from tests.parity.test_ppo_backends import make_config, rollout_batch

TOL = 1e-4
SCORES = np.array([1.0, 0.0, 0.25, 0.75])

USER_LOSS = '''
from strop.objectives.losses import policy_loss
from strop.objectives.roles import RolePlan


@policy_loss(reads=("ref_logprobs",), sequence_level=True)
def gated_reinforce(ops, inputs, objective):
    """REINFORCE with the ratio, damped by each rollout's mean drift, plus a squared
    log-ratio to the reference."""
    xp = ops.xp
    log_ratio = inputs["logprobs"] - inputs["old_logprobs"]
    drift = ops.segment_mean(ops.stop_gradient(log_ratio), inputs["segments"], inputs["on"])
    to_ref = inputs["logprobs"] - inputs["ref_logprobs"]
    ratio = xp.exp(xp.clip(log_ratio, -20.0, 20.0))
    loss = -inputs["advantages"] * ratio * xp.exp(-xp.abs(drift)) + 0.5 * to_ref * to_ref
    return loss, {"to_ref": to_ref * to_ref, "drift": xp.abs(drift)}
'''


def test_a_loss_from_a_file_trains_the_same_on_jax_and_torch(tiny_model_dir, tmp_path):
    (tmp_path / "my_loss.py").write_text(USER_LOSS)
    model = tiny_model_dir("qwen2")
    config = make_config(
        model, "seed=5", "ppo.advantage_estimator=grpo", "ppo.kl_coef=0.1",
        "ppo.kl_estimator=k3", "optim.name=sgd", "optim.lr=1.0", "optim.weight_decay=0.0", "ppo.mini_batch_size=2",
        f"ppo.policy_loss={tmp_path / 'my_loss.py'}:gated_reinforce",
    )  # fmt: skip
    batch = rollout_batch(read_model_spec(model).vocab_size, seed=12)
    stats = {}
    engines = {}
    for name, build in ENGINES.items():
        engine = engines[name] = build(
            config, total_updates=4, plan=RolePlan.from_config(config), checkpoints=None
        )
        stats[name] = []
        for iteration in range(2):
            old, ref = engine.logprobs(batch), engine.logprobs(batch, reference=True)
            arrays, _ = build_experience(batch, SCORES, old, ref, None, config.ppo)
            rng = np.random.default_rng([config.seed, iteration])
            for mini in minibatches(arrays, config.ppo.mini_batch_size, "token_mean", rng):
                stats[name].append(engine.train_policy(mini, 1))
    assert len(stats["jax"]) == 4 and {"to_ref", "drift"} <= stats["jax"][0].keys()  # its terms
    assert stats["jax"][-1]["to_ref"] > 0 and stats["jax"][-1]["drift"] > 0  # it trained
    for jax_step, torch_step in zip(stats["jax"], stats["torch"], strict=True):
        assert jax_step.keys() == torch_step.keys()
        for key, value in jax_step.items():
            np.testing.assert_allclose(torch_step[key], value, rtol=TOL, atol=TOL, err_msg=key)
    after = {name: engine.lora_weights()["actor"] for name, engine in engines.items()}
    for path, pair in after["jax"].items():
        for x, y in zip(pair, after["torch"][path], strict=True):
            np.testing.assert_allclose(y, x, atol=TOL, rtol=TOL, err_msg=path)


DOCS_LOSS = '''
import numpy


def capped(ops, inputs, objective):
    """docs/ppo.md's ops with Python numbers: the same on JAX and torch."""
    xp = ops.xp
    ratio = xp.exp(xp.clip(inputs["logprobs"] - inputs["old_logprobs"], -20.0, 20.0))
    capped = xp.minimum(ratio, 1.0 + objective.clip_high)
    floor = xp.maximum(capped, 1 - objective.clip_low)
    return -inputs["advantages"] * xp.where(inputs["advantages"] > 0, floor, 1.0), {}


def broken(ops, inputs, objective):
    ratio = ops.xp.exp(inputs["logprobs"] - inputs["old_logprobs"])
    return numpy.log(ratio.undefined), {}
'''
BROKEN_LINE = 16  # the line of DOCS_LOSS that raises


def micro_case(seed: int = 0):
    """A micro-batch (2 rows, 6 columns, a vocabulary of 7) and its logits, in numpy."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(2, 6, 7)).astype(np.float32)
    mask = np.array([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], np.float32)
    micro = {
        "input_ids": rng.integers(0, 7, size=(2, 6)),
        "attention_mask": np.ones((2, 6), np.int32),
        "old_logprobs": (-rng.exponential(1.5, size=(2, 6))).astype(np.float32),
        "advantages": rng.normal(size=(2, 6)).astype(np.float32),
        "loss_weights": aggregation_weights(mask, "token_mean"),
    }
    return logits, micro


def objective_for(loss: str) -> PolicyObjective:
    return PolicyObjective(
        temperature=1.0, clip_low=0.2, clip_high=0.28, dual_clip=None, kl_in_loss=False,
        kl_coef=0.0, kl_estimator="k1", entropy_coef=0.0, policy_loss=loss,
    )  # fmt: skip


def micro_loss(impl: str, logits, micro, objective):
    """``policy_micro_loss`` on a backend: under ``jit`` on JAX (traced, as the update
    traces it), eagerly on torch; the loss as a float."""
    if impl == "jax":
        import jax
        import jax.numpy as jnp

        from strop.backends.jax.losses import OPS

        arrays = {k: jnp.asarray(v) for k, v in micro.items()}
        run = jax.jit(lambda z, m: policy_micro_loss(OPS, z, m, objective)[0])
        return float(run(jnp.asarray(logits), arrays))
    import torch

    from strop.backends.torch.losses import OPS

    arrays = {k: torch.as_tensor(v) for k, v in micro.items()}
    return float(policy_micro_loss(OPS, torch.as_tensor(logits), arrays, objective)[0])


def numpy_capped_loss(logits, micro, clip_low, clip_high) -> float:
    z = logits[:, :-1].astype(np.float64)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    chosen = np.take_along_axis(logp, micro["input_ids"][:, 1:, None], -1)[..., 0]
    logp = np.pad(chosen, ((0, 0), (1, 0)))
    ratio = np.exp(logp - micro["old_logprobs"])
    adv = micro["advantages"]
    floor = np.maximum(np.minimum(ratio, 1 + clip_high), 1 - clip_low)
    per_token = -adv * np.where(adv > 0, floor, 1.0)
    weights = micro["loss_weights"]
    return float(np.where(weights > 0, per_token * weights, 0.0).sum())


@pytest.mark.parametrize("impl", ["jax", "torch"])
def test_a_loss_with_python_numbers_runs_the_same_on_both_backends(impl, tmp_path):
    """The loss docs/ppo.md leads a user to write (``xp.minimum(ratio, 1.0 + clip_high)``)
    raised a TypeError on torch; it gives the numpy loss on both backends."""
    (tmp_path / "my_loss.py").write_text(DOCS_LOSS)
    logits, micro = micro_case()
    objective = objective_for(f"{tmp_path / 'my_loss.py'}:capped")
    expected = numpy_capped_loss(logits, micro, 0.2, 0.28)
    assert micro_loss(impl, logits, micro, objective) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("impl", ["jax", "torch"])
def test_an_exception_in_a_loss_is_one_line_naming_the_function_and_its_line(impl, tmp_path):
    (tmp_path / "my_loss.py").write_text(DOCS_LOSS)
    logits, micro = micro_case()
    objective = objective_for(f"{tmp_path / 'my_loss.py'}:broken")
    with pytest.raises(PolicyLossError) as info:
        micro_loss(impl, logits, micro, objective)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    assert message.startswith(f"ppo.policy_loss: broken() in {tmp_path / 'my_loss.py'} raised at ")
    assert f"my_loss.py:{BROKEN_LINE}: AttributeError: " in message and "undefined" in message
