"""The runs the FSDP2 test repeats in one process and in two (shared by both sides)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from strop.backends.torch.lora import full_tensor, hf_module_path, lora_modules
from strop.config import Config, load_config
from strop.io.peft import AdapterWeights

COMMON = ["backend=torch", "optim.lr=1e-2", "optim.warmup_steps=0", "optim.max_grad_norm=0.5"]


def lora_config(model_dir: Path, run_dir: Path) -> Config:
    return load_config(
        "tiny",
        [
            *COMMON,
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            "lora.enabled=true",
            "lora.target_modules=[.*_proj, lm_head]",
        ],
    )


def full_config(model_dir: Path, run_dir: Path) -> Config:
    return load_config(
        "tiny", [*COMMON, f"model.path={model_dir}", f"run_dir={run_dir}", "lora.enabled=false"]
    )


def global_batch(rows: int = 8, length: int = 12) -> dict[str, np.ndarray]:
    """A fixed batch with right padding and prompt tokens masked out of the loss."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 256, (rows, length))
    mask = np.ones_like(ids)
    for row in range(rows):
        mask[row, length - row % 4 :] = 0
    loss_mask = mask.copy()
    loss_mask[:, :3] = 0
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": loss_mask}


def seeded_adapter(model: torch.nn.Module, seed: int = 3) -> AdapterWeights:
    """Non-zero A and B for every adapted module, so every adapter gets a gradient."""
    rng = np.random.default_rng(seed)
    weights = {}
    for path, module in sorted(lora_modules(model).items()):
        a_shape = tuple(module.lora_A["default"].weight.shape)
        b_shape = tuple(module.lora_B["default"].weight.shape)
        weights[path] = (
            (0.1 * rng.standard_normal(a_shape)).astype(np.float32),
            (0.1 * rng.standard_normal(b_shape)).astype(np.float32),
        )
    return weights


def named_grads(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Copies of the whole gradients by parameter name (collective under FSDP)."""
    return {
        hf_module_path(name): full_tensor(param.grad).numpy().copy()
        for name, param in model.named_parameters()
        if param.grad is not None
    }


PROMPTS = [[5, 17, 42, 99, 7], [3, 1], [250, 251, 252, 253, 254, 255, 1, 2, 3]]


def sample_prompts(policy) -> dict[str, np.ndarray]:
    """Greedy and sampled responses to :data:`PROMPTS` (every rank must call it)."""
    from strop.generation import SamplingParams

    out = {}
    for name, params in (
        ("greedy", SamplingParams(max_new_tokens=8, temperature=0.0)),
        ("sampled", SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20)),
    ):
        generation = policy.generate(PROMPTS, params, seed=5, eos_ids=[3], pad_id=0)
        out[f"{name}/tokens"] = generation.tokens
        out[f"{name}/logprobs"] = generation.logprobs
        out[f"{name}/lengths"] = generation.lengths
    return out


def sft_gradients(policy, batch, micro_batches: int) -> tuple[float, float]:
    """An SFT pass of a ``TorchPolicy`` over ``batch`` that leaves the gradients and applies
    nothing: (summed loss, target tokens)."""
    from strop.objectives.sft import SFT_BATCH, target_tokens, with_loss_weights

    weighted = with_loss_weights(batch)
    loss, _ = policy.trainer.accumulate(
        weighted, SFT_BATCH, micro_batches, policy.micro_loss, dropout=True
    )
    count = target_tokens(batch["loss_mask"])
    return loss * count, count
