"""SmolLM3: the common decoder with RoPE left out of some layers (``no_rope_layers[i]`` is 1
where layer ``i`` uses RoPE, 0 where it does not: every 4th layer in SmolLM3-3B), and
sliding-window attention on the layers without RoPE when ``use_sliding_window``."""

from strop.errors import ModelError
from strop.models import Family
from strop.models.families.qwen2 import qwen_layer_types
from strop.models.parsing import FULL, SLIDING, attention_biases, build_layers, require_activation


def smollm3_fields(cfg, common, source):
    n = common["num_layers"]
    uses_rope = cfg.get("no_rope_layers")
    if uses_rope is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        uses_rope = [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n or any(flag not in (0, 1) for flag in uses_rope):
        raise ModelError(f"{source}: no_rope_layers must list {n} flags of 0 or 1")
    nope_sliding = [FULL if flag else SLIDING for flag in uses_rope]  # transformers' default
    types, window = qwen_layer_types(cfg, common, source, default=nope_sliding)
    return {
        "layers": build_layers(
            cfg,
            common,
            source,
            types=types,
            sliding_window=window,
            no_rope=[not flag for flag in uses_rope],
        ),
        **attention_biases(cfg),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "activation": require_activation(cfg, source, allowed={"silu": "silu"}),
    }


FAMILIES = (Family("smollm3", "SmolLM3ForCausalLM", "SmolLM3 (3B)", smollm3_fields),)
