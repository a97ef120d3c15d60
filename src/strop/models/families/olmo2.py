"""OLMo 2 / OLMo 3: RMSNorm after each sub-layer (on its output, before the residual add;
no norm before them) and on the whole q and k projections (``heads x head_dim`` wide)
before RoPE. OLMo 3 adds sliding-window layers (``layer_types``) with RoPE per type."""

from strop.models import Family
from strop.models.parsing import (
    FULL,
    SLIDING,
    attention_biases,
    build_layers,
    layer_types,
    optional_window,
    require_activation,
)


def olmo2_fields(cfg, common, source):
    n = common["num_layers"]
    types = layer_types(cfg, n, source, [FULL] * n)
    window = optional_window(cfg, source) if SLIDING in types else None
    return {
        "layers": build_layers(cfg, common, source, types=types, sliding_window=window),
        **attention_biases(cfg),
        "qk_norm": "projection",
        "norm_placement": "post",
        "norm_scale_in_float32": True,
        "activation": require_activation(cfg, source, allowed={"silu": "silu"}),
    }


FAMILIES = (
    Family("olmo2", "Olmo2ForCausalLM", "OLMo 2 (1B-32B)", olmo2_fields),
    Family("olmo3", "Olmo3ForCausalLM", "OLMo 3 (7B, 32B)", olmo2_fields),
)
