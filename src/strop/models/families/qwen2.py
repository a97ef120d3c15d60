"""Qwen2 / Qwen2.5: Llama with biases on q, k and v; sliding-window attention on the layers
from ``max_window_layers`` on when ``use_sliding_window`` (or as ``layer_types`` says)."""

from strop.models import Family
from strop.models.parsing import (
    FULL,
    SLIDING,
    build_layers,
    layer_types,
    optional_window,
    require_activation,
)


def qwen_layer_types(cfg, common, source, default=None):
    """Qwen's windows, as transformers derives them: none unless ``use_sliding_window``;
    then ``layer_types``, else ``default``, else sliding from layer ``max_window_layers``
    on."""
    n = common["num_layers"]
    window = optional_window(cfg, source) if cfg.get("use_sliding_window") else None
    if window is None:
        return [FULL] * n, None
    first = cfg.get("max_window_layers", n)
    default = default or [SLIDING if i >= first else FULL for i in range(n)]
    return layer_types(cfg, n, source, default), window


def qwen2_fields(cfg, common, source):
    types, window = qwen_layer_types(cfg, common, source)
    return {
        "layers": build_layers(cfg, common, source, types=types, sliding_window=window),
        "qkv_bias": True,
        "activation": require_activation(cfg, source, allowed={"silu": "silu"}),
    }


FAMILIES = (Family("qwen2", "Qwen2ForCausalLM", "Qwen2, Qwen2.5", qwen2_fields),)
