"""Same config, same seed: the JAX and torch backends start from the same weights.

Nothing is copied from one backend to the other here: each builds its policy (SFT) or
its actor-critic (PPO) from the config alone, and

- the adapters (actor and critic) and the value head both build are equal, and equal to
  :mod:`strop.lora_init`'s values for the seed (also on a sharded JAX mesh);
- the first SFT steps give the same losses and gradient norms (1e-4 relative);
- the first PPO iteration, on an identical rollout (samplers draw different tokens on
  each backend, so the rollout is fixed here), gives the same forwards, experience,
  critic and policy statistics and updated weights.

Before the adapters were initialised in the core, JAX drew Qwix's ``he_uniform`` A
matrices (bound sqrt(6/in)) and torch PEFT's (bound 1/sqrt(in)) from different
generators, and each value head from its own generator: the first SFT step's gradient
norms differed by about 3x.
"""

from __future__ import annotations

import numpy as np
import pytest

from strop import lora_init
from strop.backends import get_backend
from strop.backends.jax import lora as jax_lora
from strop.backends.jax.actor_critic import JaxActorCritic
from strop.backends.torch import lora as torch_lora
from strop.backends.torch.actor_critic import TorchActorCritic
from strop.config import load_config
from strop.io.model_spec import read_model_spec
from strop.io.run_identity import PolicyRun
from strop.objectives.roles import RolePlan
from strop.rl.experience import build_experience, minibatches
from tests.distributed.cases import global_batch
from tests.parity.test_ppo_backends import make_config, rollout_batch

BACKENDS = ("jax", "torch")
LORA_MODULES = {"jax": jax_lora, "torch": torch_lora}
ENGINES = {"jax": JaxActorCritic, "torch": TorchActorCritic}
SEED = 5
TOL = 1e-4


def sft_policy(backend, model_dir, tmp_path, *overrides):
    config = load_config(
        "tiny",
        [
            f"backend={backend}",
            f"model.path={model_dir}",
            f"run_dir={tmp_path / backend}",
            f"seed={SEED}",
            "lora.enabled=true",
            "lora.target_modules=[.*_proj, lm_head]",
            "optim.warmup_steps=0",
            "optim.lr=1e-2",
            "mesh.fsdp=1",
            "mesh.data=-1",
            *overrides,
        ],
    )
    return get_backend(backend).build_policy(config, PolicyRun(total_steps=10))


def expected_adapters(weights, seed: int, rank: int):
    shapes = {path: (a.shape[1], b.shape[0]) for path, (a, b) in weights.items()}
    return lora_init.adapters(seed, shapes, rank)


def assert_adapters_equal(got, expected, what: str):
    assert got.keys() == expected.keys(), what
    for path in expected:
        for x, y, name in zip(got[path], expected[path], "AB", strict=True):
            np.testing.assert_array_equal(x, y, err_msg=f"{what} {path} {name}")


@pytest.fixture(scope="module")
def qwen2(tiny_model_dir):
    return tiny_model_dir("qwen2")


@pytest.mark.parametrize(
    "jax_mesh", [("mesh.fsdp=1", "mesh.data=-1"), ("mesh.fsdp=4", "mesh.tensor=2")],
    ids=["data", "fsdp-tensor"],
)  # fmt: skip
def test_sft_adapters_are_the_cores_on_both_backends(qwen2, tmp_path, jax_mesh):
    policies = {
        "jax": sft_policy("jax", qwen2, tmp_path, *jax_mesh),
        "torch": sft_policy("torch", qwen2, tmp_path),
    }
    weights = {b: LORA_MODULES[b].adapter_weights(p.model) for b, p in policies.items()}
    expected = expected_adapters(weights["torch"], SEED, policies["torch"].config.lora.rank)
    for backend in BACKENDS:
        assert_adapters_equal(weights[backend], expected, backend)
    a = next(iter(expected.values()))[0]
    assert np.abs(a).max() <= 1 / np.sqrt(a.shape[1])  # PEFT's bound
    # a module's A depends on its path, so no two adapters start alike
    firsts = {float(a[0, 0]) for a, _ in expected.values()}
    assert len(firsts) == len(expected)


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [("float32", TOL), ("bfloat16", 5e-3)], ids=["float32", "bfloat16"]
)
def test_first_sft_steps_agree(qwen2, tmp_path, dtype, tolerance):
    """In bfloat16 too: both backends keep float32 adapters over the bfloat16 base and
    compute them in bfloat16 (docs/lora.md), so they agree to bfloat16's precision."""
    dtypes = (f"model.dtype={dtype}", f"model.param_dtype={dtype}")
    policies = {b: sft_policy(b, qwen2, tmp_path, *dtypes) for b in BACKENDS}
    stats = {b: [] for b in BACKENDS}
    for step in range(3):
        batch = global_batch(rows=8, length=12 + step % 2)
        for backend, policy in policies.items():
            stats[backend].append(policy.train_step(batch, micro_batches=2))
    for key in ("grad_norm", "loss"):
        jax_values = [s[key] for s in stats["jax"]]
        torch_values = [s[key] for s in stats["torch"]]
        np.testing.assert_allclose(torch_values, jax_values, rtol=tolerance, err_msg=key)
    assert stats["jax"][0]["grad_norm"] > 0


def test_ppo_engines_start_alike(qwen2):
    config = make_config(qwen2, f"seed={SEED}")
    weights = {
        name: build(
            config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
        ).lora_weights()
        for name, build in ENGINES.items()
    }
    rank = config.lora.rank
    for backend in BACKENDS:
        actor, critic = weights[backend]["actor"], weights[backend]["critic"]
        assert_adapters_equal(actor, expected_adapters(actor, SEED, rank), f"{backend} actor")
        critic_seed = lora_init.critic_seed(SEED)
        assert_adapters_equal(
            critic, expected_adapters(critic, critic_seed, rank), f"{backend} critic"
        )
        kernel, bias = weights[backend]["value_head"]
        expected_kernel, expected_bias = lora_init.value_head(critic_seed, kernel.shape[0])
        np.testing.assert_array_equal(kernel, expected_kernel, err_msg=backend)
        assert bias == expected_bias
    # the critic is not a copy of the actor
    path = next(iter(weights["jax"]["actor"]))
    assert not np.array_equal(weights["jax"]["actor"][path][0], weights["jax"]["critic"][path][0])


def test_first_ppo_iteration_agrees_on_the_same_rollout(qwen2):
    """The recipe's own optimizers (AdamW, clipping), each engine's own forwards and
    experience, one PPO epoch (critic then policy per mini-batch) as ``PpoLoop.iteration``
    runs it."""
    config = make_config(qwen2, f"seed={SEED}", "ppo.kl_in_reward=false", "ppo.kl_coef=0.1")
    engines = {
        name: build(config, total_updates=4, plan=RolePlan.from_config(config), checkpoints=None)
        for name, build in ENGINES.items()
    }
    batch = rollout_batch(read_model_spec(qwen2).vocab_size, seed=11)
    scores = np.array([1.0, 0.0, 0.5, 1.0])
    mask = batch["response_mask"] > 0
    micro_batches = config.ppo.mini_batch_size // config.ppo.rows_per_micro_batch

    stats = {}
    forwards = {}
    for name, engine in engines.items():
        old = engine.logprobs(batch)
        ref = engine.logprobs(batch, reference=True)
        values = engine.values(batch)
        forwards[name] = (old, ref, values)
        arrays, _ = build_experience(batch, scores, old, ref, values, config.ppo)
        rng = np.random.default_rng([config.seed, 0, 0])
        stats[name] = [
            {
                "critic": engine.train_critic(mini, micro_batches),
                "policy": engine.train_policy(mini, micro_batches),
            }
            for mini in minibatches(
                arrays, config.ppo.mini_batch_size, config.ppo.loss_aggregation, rng
            )
        ]

    for j, t in zip(forwards["jax"], forwards["torch"], strict=True):
        np.testing.assert_allclose(t[mask], j[mask], atol=TOL, rtol=TOL)
    assert len(stats["jax"]) == len(stats["torch"]) >= 1
    for jax_step, torch_step in zip(stats["jax"], stats["torch"], strict=True):
        for part in ("critic", "policy"):
            assert jax_step[part].keys() == torch_step[part].keys(), part
            for key, value in jax_step[part].items():
                np.testing.assert_allclose(
                    torch_step[part][key], value, rtol=TOL, atol=TOL, err_msg=f"{part}/{key}"
                )
    assert stats["jax"][0]["critic"]["grad_norm"] > 0
    assert stats["jax"][0]["policy"]["grad_norm"] > 0

    after = {name: engine.lora_weights() for name, engine in engines.items()}
    for role in ("actor", "critic"):
        for path, pair in after["jax"][role].items():
            for x, y in zip(pair, after["torch"][role][path], strict=True):
                np.testing.assert_allclose(y, x, atol=TOL, rtol=TOL, err_msg=f"{role} {path}")
    for x, y in zip(after["jax"]["value_head"], after["torch"]["value_head"], strict=True):
        np.testing.assert_allclose(y, x, atol=TOL, rtol=TOL)
    path = next(iter(after["jax"]["actor"]))
    assert np.abs(after["jax"]["actor"][path][1]).max() > 0  # B moved off zero
