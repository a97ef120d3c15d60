"""Tiny random checkpoints of every model family, built with ``transformers``' own config
and model classes for tests (nothing downloaded)."""

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
KINDS = {  # the first families: Qwen2 and Llama (BASE_KINDS)
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


# kind -> (model_type, extra config): one tiny model per family, carrying the flags that
# make its decoder differ from the common one. Sliding windows are shorter than
# padded_batch's longest row (12 tokens), so every parity test crosses them.
FAMILY_KINDS = {
    "qwen3": ("qwen3", {"head_dim": 32, "attention_bias": True}),
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "norm_topk_prob": True, "mlp_only_layers": [1], "decoder_sparse_step": 1},
    ),
    "mistral": ("mistral", {"head_dim": 32, "sliding_window": 5}),
    "ministral": (
        "ministral",
        {"head_dim": 16, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "gemma3": (
        "gemma3_text",
        {"head_dim": 32, "sliding_window": 4, "query_pre_attn_scalar": 24,
         "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
    ),
    "phi3": (
        "phi3",
        {"partial_rotary_factor": 0.5, "max_position_embeddings": 64,
         "original_max_position_embeddings": 8,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5,
                             "short_factor": [1.0, 1.1, 1.2, 1.3],
                             "long_factor": [1.0, 2.0, 4.0, 8.0]}},
    ),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2, "mlp_bias": True}),
}  # fmt: skip
# kind -> (model_type, extra config): decoders no family of strop's declares (the torch
# backend runs them as transformers builds them), with their own flags set.
UNREGISTERED_KINDS = {
    "granite": (
        "granite",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
         "logits_scaling": 4.0},
    ),
    "stablelm": ("stablelm", {"partial_rotary_factor": 0.5, "use_qkv_bias": True}),
    "gemma2": (  # sliding windows by layer type, soft-capping
        "gemma2",
        {"head_dim": 32, "sliding_window": 4, "query_pre_attn_scalar": 24,
         "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 50.0,
         "final_logit_softcapping": 30.0},
    ),
    "starcoder2": ("starcoder2", {"sliding_window": 5}),  # one window, no layer_types
}  # fmt: skip
BASE_KINDS = tuple(KINDS)
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # within the vocab
KINDS.update(
    {
        kind: (t, {**SPECIAL_IDS, **extra})
        for kind, (t, extra) in (FAMILY_KINDS | UNREGISTERED_KINDS).items()
    }
)


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
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = KINDS[kind]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY, **extra, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
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
