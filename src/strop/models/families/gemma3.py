"""Gemma 3 (text, 1B-27B; ``gemma3_text``): local sliding-window and global layers
(``layer_types``, else every ``sliding_window_pattern``-th layer global) with RoPE bases of
their own (``rope_local_base_freq`` 10k, global ``rope_theta`` 1M, scaling on the global
layers only), RMSNorm scaling by ``1 + weight`` before and after both sub-layers and on
queries and keys, gelu-tanh, embeddings scaled by ``sqrt(hidden_size)`` and attention
scaled by ``query_pre_attn_scalar ** -0.5``; final logits soft-capped when
``final_logit_softcapping`` is set. ``attn_logit_softcapping`` is read as transformers'
Gemma 3 reads it: not at all (its attention never caps; Gemma 2's did)."""

import math

from strop.errors import ModelError
from strop.models import Family
from strop.models.parsing import (
    FULL,
    SLIDING,
    attention_biases,
    build_layers,
    layer_types,
    optional_window,
    refuse_flags,
    require_activation,
)


def gemma3_fields(cfg, common, source):
    refuse_flags(cfg, source, use_bidirectional_attention=False)
    n = common["num_layers"]
    pattern = cfg.get("sliding_window_pattern", 6)
    types = layer_types(cfg, n, source, [SLIDING if (i + 1) % pattern else FULL for i in range(n)])
    overrides = {}
    if not isinstance(cfg.get("rope_parameters"), dict):  # transformers 4's layout
        scaling = cfg.get("rope_scaling") or {}
        overrides = {
            FULL: {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1e6), **scaling},
            SLIDING: {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)},
        }
    scalar = cfg.get("query_pre_attn_scalar", common["head_dim"])
    if not isinstance(scalar, int | float) or scalar <= 0:
        raise ModelError(f"{source}: query_pre_attn_scalar must be positive, got {scalar!r}")
    return {
        "layers": build_layers(
            cfg,
            common,
            source,
            types=types,
            sliding_window=optional_window(cfg, source),
            rope_overrides=overrides,
        ),
        **attention_biases(cfg),
        "qk_norm": "head",
        "norm_placement": "sandwich",
        "norm_weight_offset": 1.0,
        "norm_scale_in_float32": True,
        "activation": require_activation(
            cfg,
            source,
            key="hidden_activation",
            allowed={"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"},
        ),
        "embedding_scale": math.sqrt(common["hidden_size"]),
        "query_scale": float(scalar) ** -0.5,
        "final_logit_softcap": cfg.get("final_logit_softcapping"),
    }


FAMILIES = (Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 3 text (1B-27B)", gemma3_fields),)
