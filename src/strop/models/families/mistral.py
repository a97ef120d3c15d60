"""Mistral 7B / Mistral Small / Ministral: the common decoder, every layer attending over a
``sliding_window`` when the config sets one (``null`` in the newer models); Ministral
(``ministral``) names sliding and full layers in ``layer_types``."""

from strop.models import Family
from strop.models.parsing import (
    FULL,
    SLIDING,
    build_layers,
    layer_types,
    optional_window,
    require_activation,
)


def mistral_fields(cfg, common, source):
    window = optional_window(cfg, source)
    default = [SLIDING if window else FULL] * common["num_layers"]
    types = layer_types(cfg, common["num_layers"], source, default)
    return {
        "layers": build_layers(cfg, common, source, types=types, sliding_window=window),
        "activation": require_activation(cfg, source, allowed={"silu": "silu"}),
    }


FAMILIES = (
    Family(
        "mistral", "MistralForCausalLM", "Mistral 7B, Mistral Small, Mistral NeMo", mistral_fields
    ),
    Family("ministral", "MinistralForCausalLM", "Ministral (layer_types)", mistral_fields),
)
