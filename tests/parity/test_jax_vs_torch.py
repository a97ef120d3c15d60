"""The two backends agree: logits, loss, LoRA gradients, 5 AdamW steps, adapters both ways.

Both policies are built from the same tiny HF checkpoint and config (float32, one
device each), then given the same random non-zero adapter weights, so every adapter
gets a gradient from the first step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from strop.backends import get_backend
from strop.backends.base import Policy
from strop.backends.jax import lora as jax_lora
from strop.backends.torch import lora as torch_lora
from strop.backends.torch.model import forward_logits
from strop.config import load_config
from strop.io.run_identity import CheckpointPlace, PolicyRun
from tests.distributed.cases import global_batch

LORA_MODULES = {"jax": jax_lora, "torch": torch_lora}
BACKENDS = ("jax", "torch")


def build(backend, model_dir, tmp_path, *overrides):
    config = load_config(
        "tiny",
        [
            f"backend={backend}",
            f"model.path={model_dir}",
            f"run_dir={tmp_path / backend}",
            "lora.enabled=true",
            "lora.target_modules=[.*_proj, lm_head]",
            "optim.warmup_steps=0",
            "optim.lr=1e-2",
            "mesh.fsdp=1",
            "mesh.data=-1",
            *overrides,
        ],
    )
    return get_backend(backend).build_policy(
        config, PolicyRun(10, CheckpointPlace.of(config, directory=tmp_path / f"{backend}-ckpt"))
    )


def seeded_weights(policy, seed: int = 3):
    """The same random non-zero PEFT-layout adapter for both backends."""
    rng = np.random.default_rng(seed)
    shapes = LORA_MODULES[policy.backend].adapter_weights(policy.model)
    return {
        path: tuple((0.1 * rng.standard_normal(w.shape)).astype(np.float32) for w in pair)
        for path, pair in sorted(shapes.items())
    }


def logits_of(policy, ids, mask) -> np.ndarray:
    if policy.backend == "jax":
        return np.asarray(policy.model(ids, mask).logits)
    with torch.no_grad():
        return forward_logits(policy.loaded, torch.from_numpy(ids), torch.from_numpy(mask)).numpy()


@pytest.fixture
def kind() -> str:
    """The tiny checkpoint's kind (tests/tiny_models.py); a test may parametrize it."""
    return "qwen2"


@pytest.fixture
def pair(tiny_model_dir, tmp_path, kind):
    """(jax, torch) policies with identical adapter weights."""
    model_dir = tiny_model_dir(kind)
    policies = {b: build(b, model_dir, tmp_path) for b in BACKENDS}
    weights = seeded_weights(policies["jax"])
    for backend, policy in policies.items():
        LORA_MODULES[backend].set_adapter_weights(policy.model, weights, "test")
    return policies, weights


def test_logits_and_loss_agree(pair):
    policies, _ = pair
    assert all(isinstance(p, Policy) for p in policies.values())  # the loops' protocol
    batch = global_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = {b: logits_of(p, ids, mask) for b, p in policies.items()}
    real = mask.astype(bool)
    np.testing.assert_allclose(logits["torch"][real], logits["jax"][real], atol=1e-4, rtol=1e-4)
    losses = {b: p.eval_loss(batch) for b, p in policies.items()}
    assert losses["jax"][1] == losses["torch"][1]
    assert losses["torch"][0] == pytest.approx(losses["jax"][0], rel=1e-5)


def test_lora_gradients_agree(tiny_model_dir, tmp_path):
    """One SGD step with lr 1 moves each adapter weight by exactly minus its gradient."""
    model_dir = tiny_model_dir("qwen2")
    sgd = ("optim.name=sgd", "optim.lr=1.0", "optim.weight_decay=0.0", "optim.max_grad_norm=null")
    policies = {b: build(b, model_dir, tmp_path, *sgd) for b in BACKENDS}
    weights = seeded_weights(policies["jax"])
    grads = {}
    for backend, policy in policies.items():
        module = LORA_MODULES[backend]
        module.set_adapter_weights(policy.model, weights, "test")
        policy.train_step(global_batch(), micro_batches=2)
        after = module.adapter_weights(policy.model)
        grads[backend] = {
            k: [w - a for w, a in zip(weights[k], after[k], strict=True)] for k in weights
        }
    for path in weights:
        for jax_grad, torch_grad in zip(grads["jax"][path], grads["torch"][path], strict=True):
            assert np.abs(jax_grad).max() > 0, path
            np.testing.assert_allclose(torch_grad, jax_grad, atol=1e-4, rtol=1e-4, err_msg=path)


def test_five_adamw_steps_agree(pair):
    policies, _ = pair
    losses = {b: [] for b in BACKENDS}
    for step in range(5):
        batch = global_batch(rows=8, length=12 + step % 2)
        for backend, policy in policies.items():
            losses[backend].append(policy.train_step(batch, micro_batches=2)["loss"])
    np.testing.assert_allclose(losses["torch"], losses["jax"], rtol=1e-5)
    trained = {b: LORA_MODULES[b].adapter_weights(p.model) for b, p in policies.items()}
    for path, (a, b) in trained["jax"].items():
        np.testing.assert_allclose(trained["torch"][path][0], a, atol=1e-4, err_msg=path)
        np.testing.assert_allclose(trained["torch"][path][1], b, atol=1e-4, err_msg=path)


@pytest.mark.parametrize(
    ("kind", "source", "target"),
    # phi3: LoRA on the fused qkv_proj and gate_up_proj, as PEFT lays them out
    [("qwen2", "jax", "torch"), ("qwen2", "torch", "jax"), ("phi3", "jax", "torch")],
)
def test_adapter_from_one_backend_loads_in_the_other_and_in_peft(
    pair, tiny_model_dir, tmp_path, kind, source, target
):
    policies, _ = pair
    assert any("qkv_proj" in path for path in LORA_MODULES[source].adapter_weights(
        policies[source].model)) == (kind == "phi3")  # fmt: skip
    batch = global_batch()
    # something neither side started from: a training step, or (phi3, sparing the suite
    # another train-step compile) other random adapters on the source side only
    if kind == "qwen2":
        policies[source].train_step(batch, micro_batches=1)
    else:
        other = seeded_weights(policies[source], seed=4)
        LORA_MODULES[source].set_adapter_weights(policies[source].model, other, "test")
    adapter = policies[source].export_adapter(tmp_path / f"from-{source}")
    policies[target].load_adapter(adapter)

    ids, mask = batch["input_ids"], batch["attention_mask"]
    real = mask.astype(bool)
    expected = logits_of(policies[source], ids, mask)
    np.testing.assert_allclose(
        logits_of(policies[target], ids, mask)[real], expected[real], atol=1e-4
    )

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir(kind), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        via_peft = peft_model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(positions),
        ).logits.numpy()
    np.testing.assert_allclose(via_peft[real], expected[real], atol=1e-4)
