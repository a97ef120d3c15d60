"""QLoRA on JAX (``lora.base_quantization``): Qwix quantizes the frozen base (nf4 in
blocks of 64 inputs, int8 per output channel) under float32 adapters, for SFT and PPO with
a critic, and the exports of such a run (as tests/integration/test_torch_qlora.py)."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from flax import nnx

from strop.backends.jax.actor_critic import JaxActorCritic
from strop.backends.jax.lora import dense_modules
from strop.backends.jax.policy import JaxPolicy
from strop.config import load_config
from strop.generation import SamplingParams
from strop.io.model_spec import read_model_spec
from strop.io.run_identity import PolicyRun
from strop.objectives.roles import RolePlan
from strop.rl.experience import build_experience, minibatches
from tests.distributed.cases import global_batch
from tests.parity.test_ppo_backends import make_config, random_weights, rollout_batch


def policy_for(model_dir, tmp_path, *overrides) -> JaxPolicy:
    config = load_config(
        "tiny",
        [
            "backend=jax", f"model.path={model_dir}", f"run_dir={tmp_path}",
            "lora.enabled=true", "lora.target_modules=[.*_proj]", "optim.warmup_steps=0",
            "optim.lr=1e-2", *overrides,
        ],
    )  # fmt: skip
    return JaxPolicy(config, PolicyRun(total_steps=20))


def quantized_state(model: nnx.Module) -> dict[str, np.ndarray]:
    """Host copies of Qwix's quantized arrays of the base (values and scales)."""
    state = {}
    for path, module in dense_modules(model).items():
        if isinstance(module.kernel, nnx.Variable):
            continue
        qarray = module.kernel.array
        state[path] = np.asarray(qarray.qvalue.get_value()).view(np.uint8)
        state[path + ":scale"] = np.asarray(qarray.scale.get_value())
    return state


def assert_same(before, after):
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert np.array_equal(value, after[name]), f"quantized base tensor {name} changed"


# Qwix's quantized training compiles for a minute and more on an empty JAX cache (nf4 63-94 s
# of `make test` in session 38): `make test-acceptance` runs nf4, int8 and the PPO iteration;
# `make test` keeps torch's QLoRA training and JAX's nf4 export below.
@pytest.mark.acceptance
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_sft_trains_float32_adapters_over_a_bit_identical_quantized_base(
    tiny_model_dir, tmp_path, kind
):
    policy = policy_for(tiny_model_dir("qwen2"), tmp_path, f"lora.base_quantization={kind}")
    before = quantized_state(policy.model)
    assert len(before) == 2 * 2 * 7  # every projection's values and scales
    lora = nnx.state(policy.model, nnx.LoRAParam)
    assert {leaf.dtype for leaf in jax.tree.leaves(lora)} == {np.dtype(np.float32)}
    losses = [policy.train_step(global_batch(), micro_batches=1)["loss"] for _ in range(3)]
    assert losses[2] < losses[0], losses
    generation = policy.generate(  # sampling on the quantized base too
        [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3), seed=0, eos_ids=(), pad_id=0
    )
    assert np.isfinite(generation.logprobs).all()
    assert_same(before, quantized_state(policy.model))


@pytest.mark.acceptance
@pytest.mark.parametrize("estimator", ["gae"])  # critic-free GRPO: on torch, same path
def test_a_ppo_iteration_on_an_nf4_base_shared_by_actor_critic_and_reference(
    tiny_model_dir, estimator
):
    model_dir = tiny_model_dir("qwen2")
    config = make_config(
        model_dir, "backend=jax", "lora.base_quantization=nf4",
        f"ppo.advantage_estimator={estimator}", "ppo.kl_in_reward=false",
    )  # fmt: skip
    engine = JaxActorCritic(
        config, total_updates=2, plan=RolePlan.from_config(config), checkpoints=None
    )
    assert engine.plan.has_critic == (estimator == "gae")
    before = quantized_state(engine.actor_module())
    assert before
    batch = rollout_batch(read_model_spec(model_dir).vocab_size, seed=12)
    scores = np.array([1.0, 0.0, 0.5, 0.25])
    old, ref = engine.logprobs(batch), engine.logprobs(batch, reference=True)
    values = engine.values(batch) if engine.plan.has_critic else None
    arrays, _ = build_experience(batch, scores, old, ref, values, config.ppo)
    weights_before = engine.lora_weights()
    micro_batches = config.ppo.mini_batch_size // config.ppo.rows_per_micro_batch
    rng = np.random.default_rng(0)
    for mini in minibatches(arrays, config.ppo.mini_batch_size, "token_mean", rng):
        if engine.plan.has_critic:
            steps = engine.train_critic_and_policy(mini, micro_batches)
        else:
            steps = (engine.train_policy(mini, micro_batches),)
        for stats in steps:
            assert all(np.isfinite(v) for v in stats.values()), stats
    after = engine.lora_weights()
    for role in after.keys() - {"value_head"}:
        changed = [
            not np.array_equal(b, after[role][path][1])
            for path, (_, b) in weights_before[role].items()
        ]
        assert any(changed), f"the {role} adapter did not train"
    assert_same(before, quantized_state(engine.actor_module()))
    mask = batch["response_mask"] > 0  # the reference: the same quantized base, adapters off
    np.testing.assert_array_equal(engine.logprobs(batch, reference=True)[mask], ref[mask])


@pytest.mark.acceptance  # 30-50 s of JAX compiles on 2 cores; torch's QLoRA export is in make test
def test_qlora_exports_a_peft_adapter_for_the_float_base_and_a_dequantized_merge(
    tiny_model_dir, tmp_path, caplog
):
    import peft
    import torch
    import transformers

    model_dir = tiny_model_dir("qwen2")
    config = make_config(model_dir, "backend=jax", "lora.base_quantization=nf4")
    engine = JaxActorCritic(
        config, total_updates=2, plan=RolePlan.from_config(config), checkpoints=None
    )
    engine.set_lora_weights(actor=random_weights(engine, seed=3)["actor"])
    batch = global_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    real = mask.astype(bool)
    ours = np.asarray(engine.actor_module()(ids, mask).logits, np.float32)

    # The exported adapter in PEFT on the unquantized base: it differs from ours by the
    # base's nf4 rounding alone, far less than the adapter's own effect (what a wrong or
    # missing adapter would be off by).
    engine.export_adapter(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tids, tmask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.no_grad():
        float_base = base(input_ids=tids, attention_mask=tmask).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
        theirs = adapted(input_ids=tids, attention_mask=tmask).logits.numpy()
    adapter_effect = np.abs(theirs - float_base)[real].mean()
    assert np.abs(ours - theirs)[real].mean() < 0.25 * adapter_effect

    # --merged: each kernel dequantized, the adapter folded in, logged; it computes ours.
    with caplog.at_level(logging.INFO, logger="strop"):
        engine.export_merged(tmp_path / "merged")
    assert "nf4 base dequantized to float32" in caplog.text
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    with torch.no_grad():
        merged_logits = merged(input_ids=tids, attention_mask=tmask).logits.numpy()
    assert np.abs(merged_logits - ours)[real].max() < 1e-3
