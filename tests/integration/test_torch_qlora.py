"""QLoRA on torch (``lora.base_quantization``): a bitsandbytes-quantized frozen base under
float32 adapters, for SFT and PPO with a critic, and the exports of such a run."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from strop.backends.torch.actor_critic import TorchActorCritic
from strop.backends.torch.lora import hf_module_path, lora_modules, set_adapter_weights
from strop.backends.torch.model import forward_logits
from strop.backends.torch.quantized import (
    dense_weight,
    is_quantized,
    load_quantized,
    quantized_layers,
    scales,
)
from strop.generation import SamplingParams
from strop.io.model_spec import read_model_spec
from strop.objectives.roles import RolePlan
from strop.rl.experience import build_experience, minibatches
from tests.distributed.cases import global_batch, seeded_adapter
from tests.integration.test_torch_lora_training import policy_for
from tests.parity.test_ppo_backends import make_config, rollout_batch
from tests.tiny_models import FAMILY_KINDS

pytest.importorskip("bitsandbytes")


def quantized_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Copies of every quantized tensor of the base: the packed weights and their scales
    (nf4: the absmax of each block; int8: each row's scale)."""
    state = {}
    for name, layer in quantized_layers(model).items():
        state[name] = layer.weight.data.clone().numpy()
        state[name + ":scales"] = scales(layer).clone().numpy()
    return state


def assert_same(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert np.array_equal(value, after[name]), f"quantized base tensor {name} changed"


OTHER_FAMILIES = [  # nf4 on the rest of the dense families: the acceptance tier
    pytest.param(family, "nf4", marks=pytest.mark.acceptance)
    for family in FAMILY_KINDS
    if family not in ("gemma3", "qwen3_moe")  # gemma3 below; MoE: LoRA on attention only
]


@pytest.mark.parametrize(
    ("family", "kind"), [("qwen2", "nf4"), ("qwen2", "int8"), ("gemma3", "nf4"), *OTHER_FAMILIES]
)  # gemma3: sliding windows, sandwich norms, a tied head, embedding scale
def test_qlora_sft_trains_float32_adapters_over_a_bit_identical_quantized_base(
    tiny_model_dir, tmp_path, family, kind
):
    model_dir = tiny_model_dir(family)
    policy = policy_for(model_dir, tmp_path, f"lora.base_quantization={kind}")
    params = dict(policy.model.named_parameters())
    quantized = [n for n, p in params.items() if is_quantized(p)]
    spec = read_model_spec(model_dir)  # every projection; the LM head stays at param_dtype
    assert len(quantized) == sum(len(spec.layer_linears(i)) for i in range(spec.num_layers))
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    before = quantized_state(policy.model)
    losses = [policy.train_step(global_batch(), micro_batches=1)["loss"] for _ in range(3)]
    assert losses[2] < losses[0], losses
    generation = policy.generate(  # sampling (no gradients) on the quantized base too
        [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3), seed=0, eos_ids=(), pad_id=0
    )
    assert np.isfinite(generation.logprobs).all()
    assert_same(before, quantized_state(policy.model))


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_ppo_iteration_on_an_nf4_base_shared_by_actor_critic_and_reference(
    tiny_model_dir, estimator
):
    model_dir = tiny_model_dir("qwen2")
    config = make_config(
        model_dir, "backend=torch", "lora.base_quantization=nf4",
        f"ppo.advantage_estimator={estimator}", "ppo.kl_in_reward=false",
    )  # fmt: skip
    engine = TorchActorCritic(
        config, total_updates=2, plan=RolePlan.from_config(config), checkpoints=None
    )
    assert engine.plan.has_critic == (estimator == "gae")
    before = quantized_state(engine.loaded.model)
    assert before  # the one model all roles run on is quantized
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
    assert_same(before, quantized_state(engine.loaded.model))
    mask = batch["response_mask"] > 0  # the reference: the same quantized base, adapters off
    np.testing.assert_array_equal(engine.logprobs(batch, reference=True)[mask], ref[mask])


def test_qlora_exports_a_peft_adapter_for_the_float_base_and_a_dequantized_merge(
    tiny_model_dir, tmp_path, caplog
):
    import peft
    import transformers

    model_dir = tiny_model_dir("qwen2")
    policy = policy_for(model_dir, tmp_path, "lora.base_quantization=nf4")
    set_adapter_weights(policy.model, seeded_adapter(policy.model), "test")
    batch = global_batch()
    ids, mask = (torch.from_numpy(batch[k]) for k in ("input_ids", "attention_mask"))
    ours = forward_logits(policy.loaded, ids, mask)
    with policy.model.disable_adapter():
        ours_base = forward_logits(policy.loaded, ids, mask)
    real = mask.bool()

    # The exported adapter in PEFT, on the unquantized base (``theirs``) and on that base
    # with each quantized weight replaced by its dequantized value (``theirs_nf4``): the
    # latter is our model computed by PEFT, equal to ours up to the CPU matmuls; the former
    # differs from ours by the base's nf4 rounding alone, far less than the adapter's own
    # effect (what a wrong or missing adapter would be off by).
    policy.export_adapter(tmp_path / "adapter")

    def peft_logits(dequantized: bool):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if dequantized:
            for name, layer in quantized_layers(policy.model).items():
                path = hf_module_path(name)
                base.get_submodule(path).weight.data = dense_weight(layer).detach()
        with torch.no_grad():
            plain = base(input_ids=ids, attention_mask=mask).logits
            adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
            return plain, adapted(input_ids=ids, attention_mask=mask).logits

    float_base, theirs = peft_logits(dequantized=False)
    nf4_base, theirs_nf4 = peft_logits(dequantized=True)
    adapter_effect = (theirs - float_base)[real].abs().mean()  # 0.3 here
    assert (ours_base - nf4_base)[real].abs().max() < 1e-5  # the same base, in PEFT
    assert (ours - theirs_nf4)[real].abs().max() < 1e-5  # the same adapter, in PEFT
    assert (ours - theirs)[real].abs().mean() < 0.25 * adapter_effect  # 0.03: nf4's rounding

    # --merged: each kernel dequantized (float32), the adapter folded in, logged.
    with caplog.at_level(logging.INFO, logger="strop"):
        policy.export_merged(tmp_path / "merged")
    assert "nf4 base dequantized to float32" in caplog.text
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    layer = lora_modules(policy.model)["model.layers.0.self_attn.q_proj"]
    scale = policy.config.lora.alpha / policy.config.lora.rank
    expected = dense_weight(layer.base_layer) + scale * (
        layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    got = merged.model.layers[0].self_attn.q_proj.weight
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-6)
    with torch.no_grad():
        merged_logits = merged(input_ids=ids, attention_mask=mask).logits
    assert (merged_logits - ours)[real].abs().max() < 1e-4  # ours, merged


def test_bitsandbytes_int8_cast_warning_is_logged_once(tiny_model_dir, caplog):
    """bitsandbytes warns at every int8 matmul on CUDA that it casts the inputs to float16
    (a PPO run of two iterations printed 4,844 such lines); the CPU path never warns, so the
    test calls CUDA's autograd function itself, on CPU tensors (it runs there too)."""
    from bitsandbytes.autograd._functions import MatMul8bitLt

    model = load_quantized(
        tiny_model_dir("qwen2"), "int8", device=torch.device("cpu"),
        stored_dtype=torch.float32, compute_dtype=torch.float32,
    )  # fmt: skip
    layer = next(iter(quantized_layers(model).values()))
    layer.init_8bit_state()  # what Linear8bitLt.forward does before its matmul
    inputs = torch.randn(2, layer.in_features)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            MatMul8bitLt.apply(inputs, layer.weight, None, layer.bias, layer.state)
    casts = [r for r in caplog.records if r.getMessage().startswith("MatMul8bitLt")]
    assert len(casts) <= 1, [r.getMessage() for r in casts]
