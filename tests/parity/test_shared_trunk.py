"""``critic.shared_trunk``: the value head on the actor's own adapters, one update of both
over ``policy loss + value_loss_coef x value loss``.

Held to the separate-critic engine, which nobody changed for this: with SGD (lr 1, no
weight decay, no clipping) one shared update must move the actor's adapters by the sum of
what the separate engine's policy update moves its actor and its critic update moves a
critic adapter that starts equal to the actor's, and move the value head exactly as that
critic update does. The engine holds no critic adapter and one optimizer. The JAX engine
is held to the torch one: the same statistics and updated weights from the same start.
"""

from __future__ import annotations

import numpy as np
import pytest

from strop.backends.jax.actor_critic import JaxActorCritic
from strop.backends.torch.actor_critic import CRITIC_ADAPTER, TorchActorCritic
from strop.io.model_spec import read_model_spec
from strop.objectives.roles import RolePlan
from strop.rl.experience import build_experience, minibatches
from tests.parity.test_ppo_backends import (
    assert_adapters_close,
    random_weights,
    rollout_batch,
    sgd_config,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def qwen2(tiny_model_dir):
    return tiny_model_dir("qwen2")


def shared_config(model_path):
    config = sgd_config(model_path)
    critic = config.critic.model_copy(update={"shared_trunk": True})
    return config.model_copy(update={"critic": critic})


def test_one_shared_update_is_the_sum_of_the_separate_policy_and_critic_updates(qwen2):
    sgd = sgd_config(qwen2)
    separate = TorchActorCritic(
        sgd, total_updates=1, plan=RolePlan.from_config(sgd), checkpoints=None
    )
    config = shared_config(qwen2)
    shared = TorchActorCritic(
        config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
    )
    assert CRITIC_ADAPTER not in shared.loaded.model.peft_config
    assert shared.critic_trainer is None and len(shared._optimizers()) == 1

    start = random_weights(separate, seed=4)
    start["critic"] = start["actor"]  # the separate critic reads the actor's trunk too
    separate.set_lora_weights(**start)
    shared.set_lora_weights(actor=start["actor"], value_head=start["value_head"])

    batch = rollout_batch(read_model_spec(qwen2).vocab_size, seed=9)
    mask = batch["response_mask"] > 0
    values = shared.values(batch)
    np.testing.assert_allclose(values[mask], separate.values(batch)[mask], atol=TOL, rtol=TOL)
    old, ref = separate.logprobs(batch), separate.logprobs(batch, reference=True)
    old = old + np.random.default_rng(2).normal(0, 0.3, old.shape).astype(np.float32) * mask
    scores = np.array([1.0, 0.0, 0.5, 1.0])
    arrays, _ = build_experience(batch, scores, old, ref, values, config.ppo)
    mini = next(minibatches(arrays, 4, config.ppo.loss_aggregation, np.random.default_rng(3)))

    critic_stats = separate.train_critic(mini, micro_batches=2)
    policy_stats = separate.train_policy(mini, micro_batches=2)
    shared_stats = shared.train_policy(mini, micro_batches=2)

    for name, value in policy_stats.items():
        if name != "grad_norm":  # one norm over both losses' gradients
            np.testing.assert_allclose(shared_stats[name], value, atol=TOL, rtol=TOL, err_msg=name)
    for name in ("loss", "vf_clipfrac", "value_mean"):
        np.testing.assert_allclose(
            shared_stats[f"critic_{name}"], critic_stats[name], atol=TOL, rtol=TOL, err_msg=name
        )
    assert policy_stats["clipfrac"] > 0  # the clipped branch was exercised

    after, moved = shared.lora_weights(), separate.lora_weights()
    assert set(after) == {"actor", "value_head"}
    for path, (a0, b0) in start["actor"].items():
        for x0, x, policy_moved, critic_moved in zip(
            (a0, b0), after["actor"][path], moved["actor"][path], moved["critic"][path],
            strict=True,
        ):  # fmt: skip
            want = policy_moved + critic_moved - x0
            np.testing.assert_allclose(x, want, atol=TOL, rtol=1e-4, err_msg=path)
    for x, want in zip(after["value_head"], moved["value_head"], strict=True):
        np.testing.assert_allclose(x, want, atol=TOL, rtol=1e-4)
    # both losses moved the actor's adapters
    path = next(iter(start["actor"]))
    assert np.abs(moved["critic"][path][1] - start["actor"][path][1]).max() > 1e-4
    assert np.abs(moved["actor"][path][1] - start["actor"][path][1]).max() > 1e-4


def test_one_shared_update_is_the_same_on_jax_and_torch(qwen2):
    config = shared_config(qwen2)
    engines = {
        "jax": JaxActorCritic(
            config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
        ),
        "torch": TorchActorCritic(
            config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
        ),
    }
    jax_engine = engines["jax"]
    assert jax_engine.critic is None and len(jax_engine._optimizers()) == 1
    weights = engines["torch"].lora_weights()
    rng = np.random.default_rng(7)
    start = {
        "actor": {path: tuple(rng.normal(0, 0.1, x.shape).astype(np.float32) for x in pair)
                  for path, pair in weights["actor"].items()},
        "value_head": (rng.normal(0, 0.2, weights["value_head"][0].shape).astype(np.float32), 0.1),
    }  # fmt: skip
    for engine in engines.values():
        engine.set_lora_weights(**start)

    batch = rollout_batch(read_model_spec(qwen2).vocab_size, seed=11)
    mask = batch["response_mask"] > 0
    values = {name: engine.values(batch) for name, engine in engines.items()}
    np.testing.assert_allclose(values["jax"][mask], values["torch"][mask], atol=1e-4, rtol=1e-4)
    old = engines["torch"].logprobs(batch)
    old = old + np.random.default_rng(2).normal(0, 0.3, old.shape).astype(np.float32) * mask
    ref = engines["torch"].logprobs(batch, reference=True)
    arrays, _ = build_experience(
        batch, np.array([1.0, 0.0, 0.5, 1.0]), old, ref, values["torch"], config.ppo
    )
    mini = next(minibatches(arrays, 4, config.ppo.loss_aggregation, np.random.default_rng(3)))
    stats = {name: engine.train_policy(mini, micro_batches=2) for name, engine in engines.items()}
    assert stats["jax"].keys() == stats["torch"].keys()
    for key, value in stats["jax"].items():
        np.testing.assert_allclose(value, stats["torch"][key], atol=1e-4, rtol=1e-4, err_msg=key)
    assert stats["jax"]["critic_loss"] > 0

    after = {name: engine.lora_weights() for name, engine in engines.items()}
    assert set(after["jax"]) == {"actor", "value_head"}
    assert_adapters_close(after["jax"]["actor"], after["torch"]["actor"], tol=1e-4)
    for x, y in zip(after["jax"]["value_head"], after["torch"]["value_head"], strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
    assert np.abs(after["jax"]["value_head"][0] - start["value_head"][0]).max() > 1e-4
