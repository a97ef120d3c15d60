"""Qwen3 (dense, 0.6B-32B): Qwen2 without the q/k/v biases (``attention_bias`` adds them to
q, k, v and o) and with an RMSNorm per head on queries and keys before RoPE; ``head_dim``
is its own setting (128 where ``hidden_size / heads`` is 64 in Qwen3-0.6B)."""

from strop.models import Family
from strop.models.families.qwen2 import qwen_layer_types
from strop.models.parsing import attention_biases, build_layers, require_activation


def qwen3_fields(cfg, common, source):
    types, window = qwen_layer_types(cfg, common, source)
    return {
        "layers": build_layers(cfg, common, source, types=types, sliding_window=window),
        **attention_biases(cfg),
        "qk_norm": "head",
        "activation": require_activation(cfg, source, allowed={"silu": "silu"}),
    }


FAMILIES = (Family("qwen3", "Qwen3ForCausalLM", "Qwen3 dense (0.6B-32B)", qwen3_fields),)
