"""PPO's models on both backends, held to each other, to transformers and to the invariants.

- One full PPO update (critic, then policy, two micro-batches) from identical weights and
  an identical batch gives the same losses, statistics and updated weights on JAX and
  torch. SGD with lr=1 and no clipping makes "updated weights - weights" the gradient, so
  the comparison is of gradients (tolerance 1e-4, float32).
- The values the PPO loop reads (``engine.values``) equal the value head applied to
  ``transformers``' final hidden state, shifted one column right (ARCHITECTURE invariant 3).
- LoRA-PPO: base weights stay bit-identical, the value head trains, and actor, critic and
  reference share one copy of the base weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from strop.backends.jax.actor_critic import JaxActorCritic
from strop.backends.torch.actor_critic import TorchActorCritic
from strop.backends.torch.train import used_columns
from strop.config import load_config
from strop.io.model_spec import read_model_spec
from strop.objectives.roles import RolePlan
from strop.rl.experience import build_experience, minibatches

TOL = 1e-4
ENGINES = {"jax": JaxActorCritic, "torch": TorchActorCritic}
# (left padding, prompt, response, right padding) per row: 6 + 6 columns
ROWS = [(2, 4, 6, 0), (0, 6, 1, 5), (3, 3, 4, 2), (1, 5, 3, 3)]


def make_config(model_path, *overrides):
    return load_config(
        "ppo-lora-tiny",
        [
            f"model.path={model_path}",
            "mesh.fsdp=1",
            "mesh.data=-1",
            "ppo.prompts_per_step=2",
            "ppo.num_generations_per_prompt=2",
            "ppo.mini_batch_size=4",
            "ppo.micro_batch_size=2",
            "lora.target_modules=['.*_proj']",
            *overrides,
        ],
    )


def sgd_config(model_path):
    return make_config(
        model_path,
        "optim.name=sgd",
        "optim.lr=1.0",
        "optim.weight_decay=0.0",
        "optim.max_grad_norm=null",
        "critic.lr=1.0",
        "ppo.kl_in_reward=false",
        "ppo.kl_coef=0.1",
        "ppo.kl_estimator=k3",
        "ppo.entropy_coef=0.01",
        "ppo.dual_clip=3.0",
        "ppo.value_clip=0.2",
        "generation.temperature=0.7",
    )


def rollout_batch(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    width = sum(ROWS[0])
    ids = rng.integers(3, vocab, (len(ROWS), width)).astype(np.int32)
    attention = np.zeros_like(ids)
    response = np.zeros(ids.shape, np.float32)
    for row, (left, prompt, length, _) in enumerate(ROWS):
        attention[row, left : left + prompt + length] = 1
        response[row, 6 : 6 + length] = 1
        ids[row, :left] = 0
    return {"input_ids": ids, "attention_mask": attention, "response_mask": response}


def random_weights(engine, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    weights = engine.lora_weights()

    def scramble(adapter):
        return {
            path: (rng.normal(0, 0.1, a.shape).astype(np.float32),
                   rng.normal(0, 0.1, b.shape).astype(np.float32))
            for path, (a, b) in adapter.items()
        }  # fmt: skip

    kernel, _ = weights["value_head"]
    return {
        "actor": scramble(weights["actor"]),
        "critic": scramble(weights["critic"]),
        "value_head": (rng.normal(0, 0.2, kernel.shape).astype(np.float32), 0.1),
    }


def assert_adapters_close(a, b, tol=TOL):
    assert a.keys() == b.keys()
    for path in a:
        for x, y in zip(a[path], b[path], strict=True):
            np.testing.assert_allclose(x, y, atol=tol, rtol=tol, err_msg=path)


def experience_mini_batch(batch, forwards, config) -> dict[str, np.ndarray]:
    """The rows' one mini-batch of experience from ``forwards`` (old log-probs, reference
    log-probs, values), the old log-probs moved off the current ones so that the ratio
    clips on some tokens."""
    old, ref, values = forwards
    rng = np.random.default_rng(2)
    old = old + rng.normal(0, 0.3, old.shape).astype(np.float32) * (batch["response_mask"] > 0)
    arrays, _ = build_experience(
        batch, np.array([1.0, 0.0, 0.5, 1.0]), old, ref, values, config.ppo
    )
    return next(minibatches(arrays, 4, config.ppo.loss_aggregation, np.random.default_rng(3)))


@pytest.fixture(scope="module")
def qwen2(tiny_model_dir):
    return tiny_model_dir("qwen2")


def test_one_ppo_update_is_the_same_on_jax_and_torch(qwen2):
    config = sgd_config(qwen2)
    engines = {name: build(config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None)
               for name, build in ENGINES.items()}  # fmt: skip
    start = random_weights(engines["jax"], seed=1)
    for engine in engines.values():
        engine.set_lora_weights(**start)
    batch = rollout_batch(read_model_spec(qwen2).vocab_size)

    forwards = {
        name: (e.logprobs(batch), e.logprobs(batch, reference=True), e.values(batch))
        for name, e in engines.items()
    }
    mask = batch["response_mask"] > 0
    for j, t in zip(forwards["jax"], forwards["torch"], strict=True):
        np.testing.assert_allclose(j[mask], t[mask], atol=TOL, rtol=TOL)

    mini = experience_mini_batch(batch, forwards["jax"], config)  # one for both

    stats = {}
    for name, engine in engines.items():
        stats[name] = {
            "critic": engine.train_critic(mini, micro_batches=2),
            "policy": engine.train_policy(mini, micro_batches=2),
        }
    for part in ("critic", "policy"):
        jax_stats, torch_stats = stats["jax"][part], stats["torch"][part]
        assert jax_stats.keys() == torch_stats.keys(), part
        for key in jax_stats:
            np.testing.assert_allclose(jax_stats[key], torch_stats[key], rtol=TOL, atol=TOL,
                                       err_msg=f"{part}/{key}")  # fmt: skip
    assert stats["jax"]["policy"]["clipfrac"] > 0  # the clipped branch was exercised
    assert stats["jax"]["policy"]["kl_loss"] != 0

    after = {name: engine.lora_weights() for name, engine in engines.items()}
    assert_adapters_close(after["jax"]["actor"], after["torch"]["actor"])
    assert_adapters_close(after["jax"]["critic"], after["torch"]["critic"])
    np.testing.assert_allclose(after["jax"]["value_head"][0], after["torch"]["value_head"][0],
                               atol=TOL, rtol=TOL)  # fmt: skip
    np.testing.assert_allclose(after["jax"]["value_head"][1], after["torch"]["value_head"][1],
                               atol=TOL, rtol=TOL)  # fmt: skip
    moved = max(np.abs(after["jax"]["actor"][p][1] - start["actor"][p][1]).max()
                for p in start["actor"])  # fmt: skip
    assert moved > 1e-3  # the update did something


@pytest.mark.parametrize("backend", ENGINES)
def test_the_critic_and_policy_updates_in_one_call_are_the_two_calls(qwen2, backend):
    """``train_critic_and_policy`` (the PPO loop's call; one program on JAX) gives the stats
    and weights of ``train_critic`` then ``train_policy``."""
    config = make_config(qwen2, "ppo.kl_coef=0.1", "ppo.kl_estimator=k3", "ppo.value_clip=0.2")
    engines = [
        ENGINES[backend](
            config, total_updates=2, plan=RolePlan.from_config(config), checkpoints=None
        )
        for _ in range(2)
    ]
    start = random_weights(engines[0], seed=1)
    for engine in engines:
        engine.set_lora_weights(**start)
    batch = rollout_batch(read_model_spec(qwen2).vocab_size)
    e = engines[0]
    mini = experience_mini_batch(batch, (e.logprobs(batch), e.logprobs(batch, reference=True),
                                         e.values(batch)), config)  # fmt: skip
    for _ in range(2):  # the second update runs from the first one's optimizer state
        apart = (engines[0].train_critic(mini, 2), engines[0].train_policy(mini, 2))
        together = engines[1].train_critic_and_policy(mini, 2)
        for one, other in zip(apart, together, strict=True):
            assert one.keys() == other.keys()
            for key in one:
                np.testing.assert_allclose(one[key], other[key], rtol=1e-6, atol=1e-7, err_msg=key)
    assert apart[1]["grad_norm"] > 0 and apart[0]["grad_norm"] > 0
    one, other = (engine.lora_weights() for engine in engines)
    for role in ("actor", "critic"):
        assert_adapters_close(one[role], other[role], tol=1e-6)
    np.testing.assert_allclose(one["value_head"][0], other["value_head"][0], rtol=1e-6, atol=1e-7)
    moved = max(np.abs(other["actor"][p][1] - start["actor"][p][1]).max() for p in start["actor"])
    assert moved > 1e-4  # the updates did something


def test_torch_drops_padding_columns_without_changing_a_number(qwen2):
    """Torch runs each micro-batch without the columns none of its rows attends: the same
    batch with all-padding columns added on both sides gives the same forwards, losses,
    statistics and updated weights (what trimming must keep)."""
    config = sgd_config(qwen2)
    batch = rollout_batch(read_model_spec(qwen2).vocab_size, seed=6)
    left, right = 3, 5
    wide = {name: np.pad(array, ((0, 0), (left, right))) for name, array in batch.items()}
    width = batch["input_ids"].shape[1]
    assert used_columns(torch.from_numpy(wide["attention_mask"])) == slice(left, left + width)
    scores = np.array([1.0, 0.0, 0.5, 1.0])
    mask = batch["response_mask"] > 0
    seen = []
    for rollout in (batch, wide):
        engine = TorchActorCritic(
            config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
        )
        engine.set_lora_weights(**random_weights(engine, seed=1))
        old, ref, values = (
            engine.logprobs(rollout), engine.logprobs(rollout, reference=True),
            engine.values(rollout),
        )  # fmt: skip
        arrays, _ = build_experience(rollout, scores, old, ref, values, config.ppo)
        mini = next(minibatches(arrays, 4, "token_mean", np.random.default_rng(3)))
        stats = {"critic": engine.train_critic(mini, 2), "policy": engine.train_policy(mini, 2)}
        columns = slice(left, left + mask.shape[1]) if rollout is wide else slice(None)
        seen.append(([x[:, columns][mask] for x in (old, ref, values)], stats, engine))
    (narrow_forwards, narrow_stats, narrow), (wide_forwards, wide_stats, wide_engine) = seen
    for x, y in zip(narrow_forwards, wide_forwards, strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=1e-5)
    for part in ("critic", "policy"):
        assert wide_stats[part].keys() == narrow_stats[part].keys()
        for key, value in narrow_stats[part].items():
            np.testing.assert_allclose(wide_stats[part][key], value, atol=1e-5, rtol=1e-5,
                                       err_msg=f"{part}/{key}")  # fmt: skip
    after, after_wide = narrow.lora_weights(), wide_engine.lora_weights()
    assert_adapters_close(after["actor"], after_wide["actor"], tol=1e-5)
    assert_adapters_close(after["critic"], after_wide["critic"], tol=1e-5)


@pytest.mark.parametrize("backend", ENGINES)
def test_engine_values_are_the_head_on_the_previous_column(qwen2, backend):
    """values[:, t] = head(hidden[:, t - 1]) from transformers' own forward, with the
    critic adapter merged in: the PPO loop's values obey invariant 3."""
    config = make_config(qwen2)
    engine = ENGINES[backend](
        config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
    )
    weights = random_weights(engine, seed=4)
    engine.set_lora_weights(critic=weights["critic"], value_head=weights["value_head"])
    batch = rollout_batch(read_model_spec(qwen2).vocab_size, seed=5)
    got = engine.values(batch)

    model = AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32)
    scale = engine.config.lora.alpha / engine.config.lora.rank
    with torch.no_grad():
        for path, (a, b) in weights["critic"].items():
            module = model.get_submodule(path)
            module.weight += scale * torch.from_numpy(b @ a)
        ids = torch.from_numpy(batch["input_ids"]).long()
        mask = torch.from_numpy(batch["attention_mask"]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    output_hidden_states=True)  # fmt: skip
    kernel, bias = weights["value_head"]
    raw = out.hidden_states[-1].numpy() @ kernel + bias
    expected = np.concatenate([np.zeros_like(raw[:, :1]), raw[:, :-1]], axis=1)
    on = batch["response_mask"] > 0
    np.testing.assert_allclose(got[on], expected[on], atol=TOL, rtol=TOL)
    unshifted = raw
    assert not np.allclose(got[on], unshifted[on], atol=TOL)  # the check can fail


def base_arrays(engine) -> dict[str, np.ndarray]:
    """Host copies of every base (non-LoRA, non-head) weight."""
    if engine.backend == "jax":
        import jax

        leaves = jax.tree_util.tree_leaves_with_path(engine.frozen)
        return {jax.tree_util.keystr(p): np.array(v) for p, v in leaves}
    return {
        name: param.detach().cpu().numpy().copy()
        for name, param in engine.loaded.model.named_parameters()
        if "lora_" not in name
    }


@pytest.mark.parametrize("backend", ENGINES)
def test_lora_ppo_keeps_the_base_trains_the_head_and_holds_one_base(qwen2, backend):
    config = make_config(qwen2, "optim.warmup_steps=0")
    engine = ENGINES[backend](
        config, total_updates=3, plan=RolePlan.from_config(config), checkpoints=None
    )
    before = base_arrays(engine)
    head_before = engine.lora_weights()["value_head"]
    batch = rollout_batch(read_model_spec(qwen2).vocab_size, seed=6)
    old, ref, values = (
        engine.logprobs(batch),
        engine.logprobs(batch, reference=True),
        engine.values(batch),
    )
    arrays, _ = build_experience(
        batch, np.array([1.0, 0.0, 1.0, 0.0]), old, ref, values, config.ppo
    )
    for step in range(3):
        for mini in minibatches(arrays, 4, "token_mean", np.random.default_rng(step)):
            engine.train_critic(mini, 2)
            engine.train_policy(mini, 2)

    after = base_arrays(engine)
    assert before.keys() == after.keys() and before
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    kernel, bias = engine.lora_weights()["value_head"]
    assert not np.array_equal(kernel, head_before[0]) and bias != head_before[1]
    # the adapters moved the policy away from the reference
    assert not np.allclose(engine.logprobs(batch), engine.logprobs(batch, reference=True))

    if backend == "jax":
        import jax

        actor_base = jax.tree.leaves(engine.frozen)
        critic_base = jax.tree.leaves(engine.critic_frozen)
        assert len(actor_base) == len(critic_base) > 0
        assert all(a is c for a, c in zip(actor_base, critic_base, strict=True))
    else:
        model = engine.loaded.model
        assert engine.critic.lm is model and engine.reference_loaded is None
        adapters = {name.split(".lora_")[1].split(".")[1] for name, _ in model.named_parameters()
                    if ".lora_" in name}  # fmt: skip
        assert adapters == {"default", "critic"}
        # every base weight exists once: no parameter holds a second copy of another
        pointers = [p.data_ptr() for n, p in model.named_parameters() if "lora_" not in n]
        assert len(pointers) == len(set(pointers))


@pytest.mark.parametrize("backend", ENGINES)
def test_full_parameter_ppo_keeps_a_frozen_reference_and_a_separate_critic(qwen2, backend):
    config = make_config(qwen2, "lora.enabled=false", "optim.lr=1e-3", "optim.warmup_steps=0")
    engine = ENGINES[backend](
        config, total_updates=2, plan=RolePlan.from_config(config), checkpoints=None
    )
    batch = rollout_batch(read_model_spec(qwen2).vocab_size, seed=7)
    old, ref, values = (
        engine.logprobs(batch),
        engine.logprobs(batch, reference=True),
        engine.values(batch),
    )
    np.testing.assert_array_equal(old, ref)  # the reference starts as the actor
    arrays, _ = build_experience(
        batch, np.array([1.0, 0.0, 1.0, 0.0]), old, ref, values, config.ppo
    )
    mini = next(minibatches(arrays, 4, "token_mean", np.random.default_rng(0)))
    engine.train_critic(mini, 2)
    engine.train_policy(mini, 2)
    assert not np.allclose(engine.logprobs(batch), old, atol=1e-5)  # the actor moved
    np.testing.assert_array_equal(engine.logprobs(batch, reference=True), ref)  # it did not
    assert not np.allclose(engine.values(batch), values, atol=1e-5)


def test_both_engines_implement_the_actor_critic_protocol():
    from strop.backends.base import ActorCritic

    for engine in ENGINES.values():
        missing = [name for name in dir(ActorCritic)
                   if not name.startswith("_") and not hasattr(engine, name)]  # fmt: skip
        assert not missing, (engine.__name__, missing)


@pytest.mark.parametrize("backend", ENGINES)
def test_a_reference_adapter_is_the_reference_policy(qwen2, backend, tmp_path):
    """``ppo.reference_adapter``: the reference log-probabilities are those of the base
    plus that adapter in PEFT (`transformers`), and the actor's updates leave them alone."""
    from peft import PeftModel

    from strop.io.peft import save_adapter

    spec = read_model_spec(qwen2)
    rng = np.random.default_rng(3)
    weights = {}
    for layer in range(spec.num_layers):
        for module in spec.layer_linears(layer):
            out_features, in_features = spec.linear_shape(f"model.layers.{layer}.{module}")
            weights[f"model.layers.{layer}.{module}"] = (
                rng.normal(0, 0.3, (8, in_features)).astype(np.float32),
                rng.normal(0, 0.3, (out_features, 8)).astype(np.float32),
            )
    sft_adapter = save_adapter(
        tmp_path / "sft", weights, rank=8, alpha=16.0, dropout=0.0,
        target_modules=[".*_proj"], base_model=str(qwen2),
    )  # fmt: skip
    config = make_config(
        qwen2, "lora.rank=8", "lora.alpha=16", f"ppo.reference_adapter={sft_adapter}",
        "optim.lr=1e-2", "optim.warmup_steps=0", "generation.temperature=0.7",
    )  # fmt: skip
    engine = ENGINES[backend](
        config, total_updates=2, plan=RolePlan.from_config(config), checkpoints=None
    )
    batch = rollout_batch(spec.vocab_size, seed=8)
    mask = batch["response_mask"] > 0

    ids = torch.from_numpy(batch["input_ids"]).long()
    attention = torch.from_numpy(batch["attention_mask"]).long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    base = AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32)
    with torch.no_grad():
        peft = PeftModel.from_pretrained(base, sft_adapter).eval()
        logits = peft(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, :-1].double() / 0.7, -1)
    expected = np.zeros(ids.shape)
    expected[:, 1:] = logp.gather(-1, ids[:, 1:, None])[..., 0].numpy()

    ref = engine.logprobs(batch, reference=True)
    np.testing.assert_allclose(ref[mask], expected[mask], atol=TOL, rtol=TOL)
    # at another temperature on request (vLLM's raw log-probs are at 1: rl/ppo.py)
    logp_at_1 = torch.log_softmax(logits[:, :-1].double(), -1)
    expected[:, 1:] = logp_at_1.gather(-1, ids[:, 1:, None])[..., 0].numpy()
    at_1 = engine.logprobs(batch, reference=True, temperature=1.0)
    np.testing.assert_allclose(at_1[mask], expected[mask], atol=TOL, rtol=TOL)
    actor = engine.logprobs(batch)
    assert np.abs(actor[mask] - ref[mask]).max() > 0.01, "the actor starts from the base"

    scores = np.array([1.0, 0.0, 0.5, 0.2])
    arrays, _ = build_experience(batch, scores, actor, ref, engine.values(batch), config.ppo)
    mini = next(minibatches(arrays, 4, "token_mean", np.random.default_rng(0)))
    engine.train_policy(mini, 2)
    assert not np.allclose(engine.logprobs(batch)[mask], actor[mask], atol=1e-5)
    np.testing.assert_array_equal(engine.logprobs(batch, reference=True), ref)
