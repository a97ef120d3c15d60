"""Critic-free PPO (``ppo.advantage_estimator``: grpo, rloo, reinforce_pp) on both backends.

- The engine of a critic-free run allocates no critic: no value model or head, no critic
  adapter, no critic optimizer state, nothing of a critic in its checkpoint.
- One GRPO iteration (same weights from the same seed, the same rollout) gives the same
  forwards, advantages, policy statistics and updated actor on JAX and torch, and the
  advantages are the numpy oracle's (:mod:`strop.objectives.estimators`).
"""

from __future__ import annotations

import numpy as np
import pytest

from strop.backends.jax.actor_critic import JaxActorCritic
from strop.backends.torch.actor_critic import CRITIC_ADAPTER, TorchActorCritic
from strop.io.model_spec import read_model_spec
from strop.io.run_identity import CheckpointPlace
from strop.objectives import estimators
from strop.objectives.roles import RolePlan
from strop.rl.experience import build_experience, minibatches
from tests.parity.test_multi_turn_update import holey_batch
from tests.parity.test_ppo_backends import make_config, rollout_batch

ENGINES = {"jax": JaxActorCritic, "torch": TorchActorCritic}
TOL = 1e-4
SCORES = np.array([1.0, 0.0, 0.5, 0.5])  # two prompts x two responses: one equal group


@pytest.fixture(scope="module")
def qwen2(tiny_model_dir):
    return tiny_model_dir("qwen2")


def grpo_config(model_path, *overrides):
    return make_config(
        model_path, "seed=5", "ppo.advantage_estimator=grpo", "ppo.kl_in_reward=false",
        "ppo.kl_coef=0.1", "ppo.kl_estimator=k3", *overrides,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ENGINES)
def test_a_critic_free_engine_allocates_no_critic(qwen2, backend, tmp_path):
    config = grpo_config(qwen2)
    plan = RolePlan.from_config(config)
    place = CheckpointPlace.of(config, job="ppo", roles=plan, directory=tmp_path)
    engine = ENGINES[backend](config, total_updates=2, plan=plan, checkpoints=place)
    assert engine.plan.has_critic is False
    assert engine.lora_weights().keys() == {"actor"}
    if backend == "jax":
        for name in ("critic", "critic_opt", "critic_graph", "_critic_update", "head"):
            assert getattr(engine, name) is None, name
        held = [str(path) for path, _ in nnx_paths(engine)]
        assert not any("value_head" in p for p in held)
    else:
        assert engine.critic is None and engine.critic_trainer is None
        assert CRITIC_ADAPTER not in engine.loaded.model.peft_config
        names = [name for name, _ in engine.loaded.model.named_parameters()]
        assert not any(f".{CRITIC_ADAPTER}." in n or "value_head" in n for n in names)
        assert len(engine._optimizers()) == 1
        assert set(engine._state) == {"actor"}
    engine.save_checkpoint(1, {"step": 1})
    written = [p.name for p in tmp_path.rglob("*")]
    assert not any("critic" in name or "value_head" in name for name in written), written
    assert engine.restore_checkpoint(1)["step"] == 1


def nnx_paths(engine):
    import jax

    trees = {"actor": engine.actor, "frozen": engine.frozen, "actor_opt": engine.actor_opt}
    return jax.tree_util.tree_flatten_with_path(trees)[0]


def test_one_grpo_iteration_is_the_same_on_jax_and_torch(qwen2):
    """On single-turn rows, then (the same engines) on multi-turn rows whose responses have
    holes where the environment spoke: the advantages are the oracle's on the policy's
    tokens and 0 in the holes, and JAX = torch throughout."""
    config = grpo_config(qwen2)
    engines = {name: build(config, total_updates=4, plan=RolePlan.from_config(config), checkpoints=None)
               for name, build in ENGINES.items()}  # fmt: skip
    vocab = read_model_spec(qwen2).vocab_size
    for batch in (rollout_batch(vocab, seed=12), holey_batch(vocab, seed=12)):
        _one_iteration_agrees(config, engines, batch)


def _one_iteration_agrees(config, engines, batch) -> None:
    mask = batch["response_mask"] > 0
    micro_batches = config.ppo.mini_batch_size // config.ppo.rows_per_micro_batch
    forwards, arrays_of, stats = {}, {}, {}
    for name, engine in engines.items():
        old, ref = engine.logprobs(batch), engine.logprobs(batch, reference=True)
        forwards[name] = (old, ref)
        arrays, rollout_stats = build_experience(batch, SCORES, old, ref, None, config.ppo)
        arrays_of[name] = arrays
        assert rollout_stats["train/equal_score_groups"] == 1.0
        assert "old_values" not in arrays and "returns" not in arrays
        rng = np.random.default_rng([config.seed, 0, 0])
        stats[name] = [
            engine.train_policy(mini, micro_batches)
            for mini in minibatches(arrays, config.ppo.mini_batch_size, "token_mean", rng)
        ]
    expected = estimators.grpo(SCORES, 2)[:, None] * mask
    np.testing.assert_allclose(arrays_of["jax"]["advantages"], expected, rtol=1e-6, atol=1e-6)
    for j, t in zip(forwards["jax"], forwards["torch"], strict=True):
        np.testing.assert_allclose(t[mask], j[mask], atol=TOL, rtol=TOL)
    for jax_step, torch_step in zip(stats["jax"], stats["torch"], strict=True):
        assert jax_step.keys() == torch_step.keys()
        for key, value in jax_step.items():
            np.testing.assert_allclose(torch_step[key], value, rtol=TOL, atol=TOL, err_msg=key)
    assert stats["jax"][0]["grad_norm"] > 0
    after = {name: engine.lora_weights()["actor"] for name, engine in engines.items()}
    for path, pair in after["jax"].items():
        for x, y in zip(pair, after["torch"][path], strict=True):
            np.testing.assert_allclose(y, x, atol=TOL, rtol=TOL, err_msg=path)
