"""Phi-3 / Phi-4-mini: one fused ``qkv_proj`` and one fused ``gate_up_proj`` per layer,
RoPE over the first ``partial_rotary_factor`` of each head (0.75 in Phi-4-mini) with
``longrope`` scaling (short factors up to ``original_max_position_embeddings``, long ones
past it), every layer attending over ``sliding_window`` when one is set."""

from strop.models import Family
from strop.models.parsing import (
    FULL,
    SLIDING,
    build_layers,
    optional_window,
    refuse_flags,
    require_activation,
)


def phi3_fields(cfg, common, source):
    refuse_flags(cfg, source, attention_bias=False)
    window = optional_window(cfg, source)
    extra = {}
    if "original_max_position_embeddings" in cfg:  # longrope reads it from the top level
        extra["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    types = [SLIDING if window else FULL] * common["num_layers"]
    return {
        "layers": build_layers(
            cfg,
            common,
            source,
            types=types,
            sliding_window=window,
            rope_extra=extra,
            partial_rotary_factor=cfg.get("partial_rotary_factor"),
        ),
        "fused_qkv": True,
        "fused_gate_up": True,
        "activation": require_activation(cfg, source, allowed={"silu": "silu"}),
    }


FAMILIES = (Family("phi3", "Phi3ForCausalLM", "Phi-3, Phi-3.5, Phi-4-mini", phi3_fields),)
