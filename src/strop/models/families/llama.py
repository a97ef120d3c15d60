"""Llama 2 / 3.x: the common decoder (pre-norm, SwiGLU, RoPE with ``linear`` or ``llama3``
scaling); ``attention_bias`` puts biases on q, k, v and o."""

from strop.models import Family
from strop.models.parsing import (
    FULL,
    attention_biases,
    build_layers,
    refuse_flags,
    require_activation,
)


def llama_fields(cfg, common, source):
    refuse_flags(cfg, source, pretraining_tp=1)
    return {
        "layers": build_layers(
            cfg, common, source, types=[FULL] * common["num_layers"], sliding_window=None
        ),
        **attention_biases(cfg),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "activation": require_activation(cfg, source, allowed={"silu": "silu"}),
    }


FAMILIES = (Family("llama", "LlamaForCausalLM", "Llama 2, Llama 3.x", llama_fields),)
