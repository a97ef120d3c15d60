"""Tiny random Qwen2 and Llama checkpoints built with ``transformers`` for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}

# kind -> (architecture, extra config). Covers biases, tied heads, head_dim != hidden/heads
# and Llama 3 RoPE scaling.
KINDS = {
    "qwen2": ("qwen2", {"tie_word_embeddings": False}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama3": (
        "llama",
        {
            "head_dim": 32,
            "attention_bias": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
}


# Qwen2.5-1.5B-Instruct's config.json (transformers 4 layout), for shape-only checks.
QWEN25_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def build_tiny_model(kind: str, seed: int = 0, **overrides):
    """A transformers causal LM of the given kind with random weights (eval mode, float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, extra = KINDS[kind]
    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    with torch.no_grad():  # make biases and norms non-trivial so they are really tested
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def save_tiny_model(kind: str, directory: Path, **overrides) -> Path:
    build_tiny_model(kind, **overrides).save_pretrained(directory)
    return directory


def padded_batch(seed: int = 0, *, left: bool = False, vocab: int = TINY["vocab_size"]):
    """Token ids ``[3, 12]`` and an attention mask with rows of lengths 12, 9 and 5."""
    rng = np.random.default_rng(seed)
    lengths = [12, 9, 5]
    ids = rng.integers(0, vocab, size=(len(lengths), max(lengths)))
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        if left:
            mask[row, -n:] = 1
        else:
            mask[row, :n] = 1
    return ids, mask
