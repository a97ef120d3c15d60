"""LoRA and full fine-tuning with the JAX train step (issue: native NNX LoRA loop)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from peft import PeftModel
from transformers import AutoModelForCausalLM

import strop
from strop.backends.jax.lora import (
    BASE_WEIGHTS,
    adapter_weights,
    apply_lora,
    dense_modules,
    set_adapter_weights,
    trainable_filter,
)
from strop.backends.jax.sharding import make_mesh
from strop.backends.jax.train import Trainer
from strop.config import LoraConfig, OptimConfig
from strop.errors import ConfigError
from strop.io.peft import load_adapter, save_adapter
from strop.io.run_identity import PolicyRun
from tests.tiny_models import TINY, padded_batch

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def one_device():
    return make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


def host_copy(state) -> list[np.ndarray]:
    """Host copies (not live references) of every leaf of an nnx state."""
    return [np.array(leaf) for leaf in jax.tree.leaves(state)]


def make_batch(step: int, rows: int = 8, length: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    mask = np.ones((rows, length), np.int32)
    mask[::2, -3:] = 0  # some padding
    loss_mask = mask.astype(np.float32)
    loss_mask[:, :4] = 0  # a "prompt" that is not trained on
    ids = rng.integers(0, TINY["vocab_size"], (rows, length))
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def lora_setup(model_dir, mesh=None, lora=LORA, lr=1e-2, seed=0):
    handle = strop.load_model(model_dir, mesh=mesh or one_device())
    model = apply_lora(handle.model, lora, seed=seed)
    trainer = Trainer(
        model, handle.mesh, OptimConfig(lr=lr), total_steps=50, trainable=trainable_filter(True)
    )
    return model, trainer


def test_adapters_on_every_target_and_optimizer_only_over_them(tiny_model_dir):
    model, trainer = lora_setup(tiny_model_dir("qwen2"))
    modules = dense_modules(model)
    targeted = [p for p in modules if p.split(".")[-1] != "lm_head"]
    assert len(targeted) == 2 * 7
    for path in targeted:
        assert isinstance(modules[path].kernel_lora_a, nnx.LoRAParam), path
        assert isinstance(modules[path].kernel_lora_b, nnx.LoRAParam), path
    assert not hasattr(modules["lm_head"], "kernel_lora_a")

    lora_leaves = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    lora_params = sum(x.size for x in lora_leaves)
    opt_state = trainer.opt_state
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state))
    # AdamW: two float32 moments per LoRA parameter, plus int32 counters.
    counters = sum(x.nbytes for x in jax.tree.leaves(opt_state) if x.ndim == 0)
    assert opt_bytes - counters == 2 * 4 * lora_params
    assert counters <= 3 * 8
    # Optimizer-state paths are LoRA paths only.
    lora_paths = {p[-2:] for p, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    is_state = lambda x: isinstance(x, nnx.State)  # noqa: E731
    moments = [m for m in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(m)]
    moment_paths = {p[-2:] for moment in moments for p, _ in nnx.to_flat_state(moment)}
    assert len(moments) == 2  # AdamW's mu and nu
    assert moment_paths <= lora_paths and lora_paths


def test_step_trains_every_lora_b_and_keeps_base_bit_identical(tiny_model_dir):
    model, trainer = lora_setup(tiny_model_dir("llama3"))
    base_before = host_copy(nnx.state(model, BASE_WEIGHTS))
    b_before = {p: w[1].copy() for p, w in adapter_weights(model).items()}
    assert all(not b.any() for b in b_before.values())  # B starts at zero
    for step in range(2):
        trainer.step(make_batch(step), micro_batches=2)
    base_after = host_copy(nnx.state(model, BASE_WEIGHTS))
    assert len(base_after) == len(base_before) > 0
    for before, after in zip(base_before, base_after, strict=True):
        np.testing.assert_array_equal(before, after)
    for path, (_, b) in adapter_weights(model).items():
        assert not np.array_equal(b, b_before[path]), f"{path} lora_b did not change"


def test_full_finetuning_changes_base_weights(tiny_model_dir):
    handle = strop.load_model(tiny_model_dir("qwen2"), mesh=one_device())
    trainer = Trainer(
        handle.model, handle.mesh, OptimConfig(lr=1e-3), total_steps=5,
        trainable=trainable_filter(False),
    )  # fmt: skip
    before = host_copy(nnx.state(handle.model, nnx.Param))
    trainer.step(make_batch(0))
    after = host_copy(nnx.state(handle.model, nnx.Param))
    changed = sum(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert changed == len(before)
    opt_moments = [x for x in jax.tree.leaves(trainer.opt_state) if x.ndim > 0]
    assert sum(x.size for x in opt_moments) == 2 * sum(x.size for x in before)


def test_gradient_accumulation_equals_one_big_batch(tiny_model_dir):
    updates = []
    for micro_batches in (1, 4):
        model, trainer = lora_setup(tiny_model_dir("qwen2"), lr=1e-2)
        metrics = trainer.step(make_batch(0), micro_batches=micro_batches)
        updates.append((metrics, adapter_weights(model)))
    (m1, w1), (m4, w4) = updates
    assert m1["tokens"] == m4["tokens"]
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    for path in w1:
        for x1, x4 in zip(w1[path], w4[path], strict=True):
            np.testing.assert_allclose(x1, x4, atol=1e-5)


def test_step_compiles_once(tiny_model_dir):
    _, trainer = lora_setup(tiny_model_dir("qwen2"))
    for step in range(3):
        trainer.step(make_batch(step), micro_batches=2)
    assert trainer.traces.count == 1


@pytest.mark.multidevice
def test_sharded_training_matches_one_device(tiny_model_dir):
    results = []
    for mesh in (one_device(), make_mesh({"fsdp": 4, "tensor": 2})):
        model, trainer = lora_setup(tiny_model_dir("qwen2"), mesh=mesh)
        losses = [trainer.step(make_batch(s), micro_batches=2)["loss"] for s in range(3)]
        results.append((losses, adapter_weights(model)))
    (l1, w1), (l8, w8) = results
    np.testing.assert_allclose(l1, l8, rtol=1e-5)
    for path in w1:
        np.testing.assert_allclose(w1[path][1], w8[path][1], atol=1e-5)


def test_overfit_eight_examples(tiny_model_dir):
    # A random tiny model's normed hidden states times 0.02-scale head weights cannot make
    # sharp logits, so the head gets an adapter too (a real checkpoint does not need it).
    lora = LoraConfig(enabled=True, rank=16, alpha=32.0, target_modules=[".*_proj", "lm_head"])
    _, trainer = lora_setup(tiny_model_dir("qwen2"), lora=lora, lr=1e-2)
    batch = make_batch(0)
    losses = [trainer.step(batch)["loss"] for _ in range(50)]
    assert losses[-1] < 0.2 * losses[0], losses[::10]


def test_unmatched_target_pattern_is_an_error(tiny_model_dir):
    handle = strop.load_model(tiny_model_dir("qwen2"), mesh=one_device())
    config = LoraConfig(enabled=True, target_modules=[r".*\.q_proj", r".*\.qkv"])
    with pytest.raises(
        ConfigError, match=r"pattern '\.\*\\\\.qkv' matches no module.*model\.layers\.0"
    ):
        apply_lora(handle.model, config, seed=0)


def test_peft_loads_our_adapter_with_identical_logits(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    model, trainer = lora_setup(model_dir)
    for step in range(2):
        trainer.step(make_batch(step))
    ids, mask = padded_batch()
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    ours = np.asarray(model(ids, mask, positions).logits)

    save_adapter(
        tmp_path / "adapter", adapter_weights(model), rank=LORA.rank, alpha=LORA.alpha,
        dropout=0.0, target_modules=LORA.target_modules, base_model=model_dir,
    )  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()  # fmt: skip
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - theirs[valid]).max() < 1e-4
    # The adapter matters: without it the logits differ.
    plain = strop.load_model(model_dir, mesh=one_device()).logits(ids, mask)
    assert np.abs(plain[valid] - theirs[valid]).max() > 1e-3

    # And it loads back into a fresh NNX model with the same result.
    fresh, _ = lora_setup(model_dir, seed=123)
    _, weights = load_adapter(tmp_path / "adapter")
    set_adapter_weights(fresh, weights, source="adapter")
    np.testing.assert_allclose(np.asarray(fresh(ids, mask, positions).logits), ours, atol=1e-6)


@pytest.mark.acceptance  # ~50 s of compiles on an empty JAX cache
def test_a_bfloat16_base_keeps_float32_adapters_that_compute_in_bfloat16(tiny_model_dir, tmp_path):
    """Qwix makes adapters in the base weights' dtype; over a bfloat16 base an AdamW step of
    lr 1e-4 is under half a bfloat16 ulp of most A entries (uniform in ±1/8), which then
    never moved (36% of a small model's moved in 5 steps). strop keeps them float32 and
    casts them to the compute dtype for each projection (as torch's autocast does), so
    every entry trains and the activations stay bfloat16."""
    from strop.backends import get_backend
    from strop.config import load_config

    config = load_config("tiny", [
        "backend=jax", f"model.path={tiny_model_dir('qwen2')}", f"run_dir={tmp_path}",
        "model.dtype=bfloat16", "model.param_dtype=bfloat16", "lora.enabled=true",
        "lora.rank=4", "optim.lr=1e-4", "optim.warmup_steps=0",
    ])  # fmt: skip
    policy = get_backend("jax").build_policy(config, PolicyRun(total_steps=10))
    adapters = jax.tree.leaves(nnx.state(policy.model, nnx.LoRAParam))
    assert adapters and {a.dtype for a in adapters} == {np.dtype("float32")}
    base = nnx.state(policy.model, BASE_WEIGHTS)
    assert {leaf.dtype for leaf in jax.tree.leaves(base)} == {np.dtype(jnp.bfloat16)}
    # Every matmul of the forward is bfloat16 (32 of its 47 were float32 with float32
    # adapters used as stored), and the adapters are float32 again after it.
    graph, state = nnx.split(policy.model)
    ids = jnp.ones((2, 5), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graph, s)(ids, ids, ids).logits)(state)
    dots = [e.outvars[0].aval.dtype for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) > 14 and set(dots) == {np.dtype(jnp.bfloat16)}
    assert {a.dtype for a in jax.tree.leaves(nnx.state(policy.model, nnx.LoRAParam))} == {
        np.dtype("float32")
    }

    base_before, before = host_copy(base), adapter_weights(policy.model)
    for step in range(3):
        policy.train_step(make_batch(step), micro_batches=1)
    after = adapter_weights(policy.model)
    assert all((after[k][0] != before[k][0]).all() for k in after)
    for a, b in zip(base_before, host_copy(nnx.state(policy.model, BASE_WEIGHTS)), strict=True):
        assert np.array_equal(a, b)
    # The sampler's decode loop runs the model merged inside its body, from variables of
    # the outer trace (mutating those would raise): the cast swaps attributes instead.
    from strop.generation import SamplingParams

    generation = policy.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3), seed=0,
                                 eos_ids=(), pad_id=0)  # fmt: skip
    assert generation.tokens.shape == (2, 3) and np.isfinite(generation.logprobs).all()
