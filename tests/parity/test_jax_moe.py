"""Qwen3-MoE's routed experts on the JAX backend, beyond the logits and sampling of
tests/parity/test_families.py: the router's load-balancing loss and its gradient equal
transformers', the updates add it, LoRA leaves the experts alone (and refuses to target
them), and the stacked expert kernels shard over fsdp and save as per-expert tensors."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

import strop
from strop.backends.jax.lora import apply_lora, dense_modules
from strop.backends.jax.losses import OPS
from strop.backends.jax.model import CausalLM
from strop.backends.jax.ppo_steps import policy_loss
from strop.backends.jax.preference import preference_loss
from strop.backends.jax.sharding import make_mesh
from strop.backends.jax.train import MICRO_SHARE, accumulate, sft_loss, sft_micro_loss
from strop.batch.pairs import lay_out_chunks
from strop.config import LoraConfig
from strop.errors import ConfigError
from strop.io.model_spec import read_model_spec
from strop.lora_targets import match_targets
from strop.objectives.losses import ROUTER_AUX_LOSS
from strop.objectives.micro import policy_micro_loss
from strop.objectives.ppo import PolicyObjective
from strop.objectives.preference import (
    REFERENCE_INPUTS,
    PreferenceObjective,
    preference_micro_loss,
)
from strop.objectives.sft import token_mean_weights
from tests.tiny_models import padded_batch

KIND = "qwen3_moe"  # layer 0 routes over 4 experts (top 2, renormalised), layer 1 is dense


def one_device_model(model_dir: str) -> CausalLM:
    return strop.load_model(model_dir, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1])).model


def test_router_loss_and_its_gradient_equal_transformers(tiny_model_dir):
    model_dir = tiny_model_dir(KIND)
    ids, mask = padded_batch()  # padding left out of the loss: transformers' attention_mask
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    expected = reference(
        input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
        position_ids=torch.tensor(positions), output_router_logits=True,
    ).aux_loss  # fmt: skip
    expected.backward()
    expected_grad = reference.model.layers[0].mlp.gate.weight.grad.numpy().T  # [H, X]

    graphdef, state = nnx.split(one_device_model(model_dir))
    aux_loss = jax.value_and_grad(lambda s: nnx.merge(graphdef, s)(ids, mask).aux_loss)
    loss, grads = jax.jit(aux_loss)(state)
    assert abs(float(loss) - expected.item()) < 1e-5
    assert abs(expected.item() - 2) > 1e-2  # top_k = 2 would be perfectly balanced routing
    grad = grads["model"]["layers"][0]["mlp"]["gate"]["kernel"].get_value()
    np.testing.assert_allclose(grad, expected_grad, atol=1e-6)
    assert np.abs(expected_grad).max() > 1e-4


@pytest.mark.parametrize("update", ["sft", "policy", "dpo"])
def test_the_updates_add_the_router_loss_times_its_coefficient(tiny_model_dir, update):
    model = one_device_model(tiny_model_dir(KIND))
    ids, mask = padded_batch()
    micro = {"input_ids": ids, "attention_mask": mask, "loss_weights": token_mean_weights(mask),
             MICRO_SHARE: 0.5}  # fmt: skip
    graphdef, trainable, frozen = nnx.split(model, nnx.Param, ...)
    if update == "dpo":  # two pairs packed into a layout, reference sums of 0
        pairs = [(row[:4].tolist(), row[4:8].tolist(), row[8:].tolist()) for row in ids[:2]]
        micro = {**lay_out_chunks(pairs, 1), MICRO_SHARE: 0.5}
        micro |= {name: np.zeros(2, np.float32) for name in REFERENCE_INPUTS}
        ids, mask = micro["input_ids"], micro["attention_mask"]
        objective = PreferenceObjective("sigmoid", 0.5)
        loss_of = partial(preference_loss, graphdef, objective)
        alone_of = partial(preference_micro_loss, OPS, objective=objective)
    elif update == "sft":
        loss_of, alone_of = partial(sft_loss, graphdef), sft_micro_loss
    else:
        micro |= {"old_logprobs": np.zeros(ids.shape, np.float32),
                  "advantages": np.ones(ids.shape, np.float32)}  # fmt: skip
        objective = PolicyObjective(
            temperature=1.0, clip_low=0.2, clip_high=0.2, dual_clip=None, kl_in_loss=False,
            kl_coef=0.0, kl_estimator="k1", entropy_coef=0.0,
        )  # fmt: skip
        loss_of = partial(policy_loss, graphdef, objective)
        alone_of = partial(policy_micro_loss, OPS, objective=objective)

    @jax.jit
    def losses(trainable, frozen, micro):
        output = nnx.merge(graphdef, trainable, frozen)(ids, mask, micro.get("positions"))
        loss, stats = loss_of(trainable, frozen, micro)
        return loss, stats, alone_of(output.logits, micro)[0], output.aux_loss

    loss, stats, alone, aux_loss = losses(trainable, frozen, micro)
    share = 0.5 * float(aux_loss)
    assert float(stats[ROUTER_AUX_LOSS]) == pytest.approx(share, rel=1e-6)
    coef = model.spec.moe.router_aux_loss_coef
    assert float(loss - alone) == pytest.approx(coef * share, rel=1e-3)


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_accumulate_hands_each_micro_batch_its_share(micro_batches):
    def micro_loss(trainable, frozen, micro):
        return trainable * micro[MICRO_SHARE], {"shares": jnp.asarray(micro[MICRO_SHARE])}

    batch = {"x": jnp.ones((micro_batches, 4 // micro_batches))}
    grads, loss, stats = accumulate(micro_loss, jnp.float32(3.0), None, batch)
    assert (float(grads), float(loss), float(stats["shares"])) == pytest.approx((1.0, 3.0, 1.0))


def test_lora_adapts_attention_and_dense_mlps_and_refuses_the_experts(tiny_model_dir):
    model = nnx.eval_shape(lambda: CausalLM(read_model_spec(tiny_model_dir(KIND))))
    with pytest.raises(ConfigError, match="ragged_dot") as refused:
        apply_lora(model, LoraConfig(enabled=True, target_modules=[r".*\.experts"]), seed=0)
    assert "\n" not in str(refused.value)
    defaults = match_targets(LoraConfig(enabled=True).target_modules, list(dense_modules(model)))
    attention = [f"self_attn.{name}_proj" for name in "qkvo"]
    mlp = [f"mlp.{name}_proj" for name in ("gate", "up", "down")]
    assert sorted(defaults) == sorted(
        f"model.layers.{i}.{name}" for i, names in enumerate((attention, attention + mlp))
        for name in names
    )  # fmt: skip


@pytest.mark.multidevice
def test_experts_shard_over_fsdp_and_save_as_per_expert_tensors(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir(KIND)
    handle = strop.load_model(model_dir, mesh={"fsdp": 4, "tensor": 2})
    experts = handle.model.model.layers[0].mlp.experts
    for kernel, spec in ((experts.gate_proj, ("fsdp", None, "tensor")),
                         (experts.down_proj, ("fsdp", "tensor", None))):  # fmt: skip
        value = kernel.get_value()  # [4 experts, ...]: one whole expert per fsdp shard
        expected = NamedSharding(value.sharding.mesh, PartitionSpec(*spec))
        assert value.sharding.is_equivalent_to(expected, value.ndim), value.sharding.spec
    saved = load_file(handle.save(tmp_path / "saved") / "model.safetensors")
    original = load_file(f"{model_dir}/model.safetensors")
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(saved[name], tensor, err_msg=name)
