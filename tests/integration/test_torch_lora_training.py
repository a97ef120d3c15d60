"""LoRA and full fine-tuning with the torch backend (PEFT + the torch train step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strop.backends.torch.lora import lora_modules
from strop.backends.torch.policy import TorchPolicy
from strop.config import load_config
from strop.errors import ConfigError
from strop.io.run_identity import CheckpointPlace, PolicyRun
from tests.distributed.cases import global_batch


def policy_for(model_dir, tmp_path, *overrides) -> TorchPolicy:
    config = load_config(
        "tiny",
        [
            "backend=torch",
            f"model.path={model_dir}",
            f"run_dir={tmp_path}",
            "lora.enabled=true",
            "lora.target_modules=[.*_proj, lm_head]",
            "optim.warmup_steps=0",
            "optim.lr=1e-2",
            *overrides,
        ],
    )
    return TorchPolicy(
        config, PolicyRun(20, CheckpointPlace.of(config, directory=tmp_path / "ckpt"))
    )


def host_copies(model, trainable: bool) -> dict[str, np.ndarray]:
    return {
        name: p.detach().to(torch.float32, copy=True).numpy()  # exact for bf16 too
        for name, p in model.named_parameters()
        if p.requires_grad == trainable
    }


def test_only_adapters_train_and_base_weights_stay_bit_identical(tiny_model_dir, tmp_path):
    policy = policy_for(tiny_model_dir("qwen2_tied"), tmp_path)
    adapted = lora_modules(policy.model)
    assert len(adapted) == 2 * 7 + 1  # 7 projections per layer, and the LM head
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer_params = [p for g in policy.trainer.optimizer.param_groups for p in g["params"]]
    assert len(optimizer_params) == len(trainable)

    base_before = host_copies(policy.model, trainable=False)
    adapters_before = host_copies(policy.model, trainable=True)
    for _ in range(3):
        policy.train_step(global_batch(), micro_batches=2)
    for name, before in base_before.items():
        after = dict(policy.model.named_parameters())[name].detach().numpy()
        assert np.array_equal(before, after), f"base weight {name} changed"
    changed = host_copies(policy.model, trainable=True)
    for name in adapters_before:
        if ".lora_B." in name:
            assert not np.array_equal(adapters_before[name], changed[name]), name
    # Optimizer state: two float32 moments per adapter parameter, nothing else.
    state = policy.trainer.optimizer.state
    assert set(map(id, state)) == set(map(id, optimizer_params))
    for param_state in state.values():
        assert param_state["exp_avg"].dtype == torch.float32


def test_full_finetuning_changes_every_weight(tiny_model_dir, tmp_path):
    policy = policy_for(tiny_model_dir("qwen2"), tmp_path, "lora.enabled=false")
    before = host_copies(policy.model, trainable=True)
    assert len(before) == len(list(policy.model.parameters()))
    for _ in range(2):
        policy.train_step(global_batch(), micro_batches=1)
    after = host_copies(policy.model, trainable=True)
    assert all(not np.array_equal(before[n], after[n]) for n in before)


def test_micro_batches_do_not_change_the_update(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    results = []
    for micro in (1, 4):
        policy = policy_for(model_dir, tmp_path / str(micro))
        before = host_copies(policy.model, trainable=True)
        metrics = policy.train_step(global_batch(), micro_batches=micro)
        results.append((metrics, before, host_copies(policy.model, trainable=True)))
    (one, start, one_weights), (four, _, four_weights) = results
    assert one["tokens"] == four["tokens"]
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert four["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    # AdamW's first step moves each weight by lr * g / (|g| + eps) (plus decay): where a
    # gradient entry is of the order of eps (1e-8) that ratio amplifies float rounding of
    # the summed micro-batch gradients, so those entries (a step well below lr) are
    # compared loosely; every other entry moves by about lr and must agree to 1e-6.
    lr = 1e-2
    for name, value in one_weights.items():
        step = np.abs(value - start[name])
        sharp = step > 0.9 * lr
        np.testing.assert_allclose(four_weights[name][sharp], value[sharp], atol=1e-6, err_msg=name)
        np.testing.assert_allclose(four_weights[name], value, atol=0.1 * lr, err_msg=name)
        if ".lora_B." in name:  # A has no gradient while B is 0: only decay moves it
            assert sharp.mean() > 0.5, name  # most entries of B take a full step


def test_target_pattern_matching_nothing_is_a_config_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"pattern 'nothing_proj' matches no module"):
        policy_for(tiny_model_dir("qwen2"), tmp_path, "lora.target_modules=[nothing_proj]")


def test_lora_on_routed_experts_is_refused_clearly(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="routed experts' stacked parameters"):
        policy_for(tiny_model_dir("qwen3_moe"), tmp_path)


def test_tensor_parallel_is_refused_clearly(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="tensor parallelism is not supported"):
        policy_for(tiny_model_dir("qwen2"), tmp_path, "mesh.tensor=2", "mesh.fsdp=1")


def test_bf16_base_keeps_float32_adapters_and_feeds_them_bf16_activations(tiny_model_dir, tmp_path):
    """Over a bf16 base the adapters stay float32 (the optimizer updates float32 values)
    and their matmuls take the bf16 activations as they are, in training and sampling.
    PEFT would copy every adapted layer's input to float32: on an H200 that made a LoRA
    step at Qwen2.5-1.5B's shapes slower than a full fine-tuning step (docs/benchmarks.md)."""
    from strop.generation import SamplingParams

    policy = policy_for(
        tiny_model_dir("qwen2"), tmp_path, "model.dtype=bfloat16", "model.param_dtype=bfloat16"
    )
    params = dict(policy.model.named_parameters())
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in params.values() if not p.requires_grad} == {torch.bfloat16}
    seen = []  # the dtype of what each adapter's first matmul receives
    for name, module in policy.model.named_modules():
        if name.endswith(".lora_A.default"):
            module.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))

    base_before = host_copies(policy.model, trainable=False)
    adapters_before = host_copies(policy.model, trainable=True)
    for _ in range(2):
        assert np.isfinite(policy.train_step(global_batch(), micro_batches=1)["loss"])
    assert seen and set(seen) == {torch.bfloat16}
    after = host_copies(policy.model, trainable=True)
    assert any(not np.array_equal(adapters_before[n], after[n]) for n in after if ".lora_B." in n)
    for name, value in host_copies(policy.model, trainable=False).items():
        assert np.array_equal(base_before[name], value), name

    seen.clear()
    generation = policy.generate(
        [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=4), seed=0, eos_ids=(), pad_id=0
    )
    assert generation.tokens.shape == (2, 4) and set(seen) == {torch.bfloat16}
    assert np.isfinite(generation.logprobs).all()


def test_building_a_lora_model_shows_no_future_warning(tiny_model_dir, tmp_path):
    """Every torch run printed transformers' FutureWarning "`is_gradient_checkpointing` is
    deprecated": PEFT's PeftModel reads that property when it wraps the model."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy_for(tiny_model_dir("qwen2_tied"), tmp_path)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []


def test_moe_training_adds_the_router_balance_loss_as_transformers_does(tiny_model_dir, tmp_path):
    """Routed experts: an update's loss is transformers' (token-mean cross-entropy plus
    ``router_aux_loss_coef`` times the load-balancing loss over the real tokens), and the
    balance loss is logged as ``moe/aux_loss``."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("qwen3_moe")
    batch = global_batch()
    ids, mask = (torch.from_numpy(batch[k]) for k in ("input_ids", "attention_mask"))
    labels = ids.masked_fill(torch.from_numpy(batch["loss_mask"]) == 0, -100)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(
            input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True
        )
    policy = policy_for(model_dir, tmp_path, "lora.enabled=false")
    stats = policy.train_step(batch, micro_batches=1)
    assert reference.config.router_aux_loss_coef > 0 and float(expected.aux_loss) > 0
    np.testing.assert_allclose(stats["moe/aux_loss"], float(expected.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(stats["loss"], float(expected.loss), rtol=1e-5)
