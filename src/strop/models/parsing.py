"""What every family's ``config.json`` parser shares: the common sizes, the activation
check, and the per-layer attention windows and RoPE (``layer_types``, ``sliding_window``,
``rope_parameters`` per layer type, layers without RoPE).

Each function reads a raw config dict and raises a one-line
:class:`~strop.errors.ModelError` naming ``source`` (the config's path) and the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from strop.errors import ModelError
from strop.models.rope import Rope, parse_rope, rope_parameters_by_layer_type
from strop.models.spec import LayerSpec

FULL, SLIDING = "full_attention", "sliding_attention"
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
MAX_LAYERS = 4096
"""More layers than any decoder has (the largest have ~130): a config past it is damaged
or hostile, and is refused before a per-layer description is built."""


def positive_int(cfg: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    """``cfg[key]``, a positive integer (``default`` when absent or null, if given)."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def common_fields(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The fields every decoder has (sizes, norm eps, tied head, positions, BOS/EOS),
    checked: missing or absurd sizes, and heads that do not group over the KV heads."""
    sizes = {key: positive_int(cfg, key, source) for key in _REQUIRED_SIZES}
    if sizes["num_hidden_layers"] > MAX_LAYERS:
        raise ModelError(
            f"{source}: num_hidden_layers={sizes['num_hidden_layers']} is more than any "
            f"decoder has (at most {MAX_LAYERS})"
        )
    heads = sizes["num_attention_heads"]
    kv_heads = positive_int(cfg, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise ModelError(
            f"{source}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    head_dim = positive_int(cfg, "head_dim", source, default=sizes["hidden_size"] // heads)
    intermediate = positive_int(cfg, "intermediate_size", source)
    try:
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        max_positions = int(cfg.get("max_position_embeddings", 32768))
    except (TypeError, ValueError) as err:
        raise ModelError(f"{source}: malformed size field ({err})") from None
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return {
        "vocab_size": sizes["vocab_size"],
        "hidden_size": sizes["hidden_size"],
        "num_layers": sizes["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "rms_norm_eps": eps,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "max_position_embeddings": max_positions,
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_ids": eos_ids,
        "raw": dict(cfg),
    }


def require_activation(
    cfg: Mapping[str, Any], source: str, *, key: str = "hidden_act", allowed: Mapping[str, str]
) -> str:
    """The MLP's activation: ``cfg[key]`` mapped through ``allowed`` (HF name -> strop's);
    any other is refused naming the flag."""
    name = cfg.get(key, next(iter(allowed)))
    if name not in allowed:
        raise ModelError(
            f"{source}: {key}={name!r} is not supported for model_type "
            f"{cfg.get('model_type')!r} (supported: {', '.join(allowed)})"
        )
    return allowed[name]


def refuse_flags(cfg: Mapping[str, Any], source: str, **unsupported: Any) -> None:
    """Refuse, naming the flag, each ``flag=value`` of ``unsupported`` the config sets to a
    value other than the given harmless one (e.g. ``attn_logit_softcapping=None``)."""
    for flag, harmless in unsupported.items():
        value = cfg.get(flag, harmless)
        if value != harmless and value is not None:
            raise ModelError(
                f"{source}: {flag}={value!r} is not supported for model_type "
                f"{cfg.get('model_type')!r}"
            )


def layer_types(cfg: Mapping[str, Any], num_layers: int, source: str, default: Sequence[str]):
    """Each layer's attention type: the config's ``layer_types`` if it has them, else
    ``default`` (what the family derives from its older fields)."""
    types = cfg.get("layer_types") or list(default)
    if len(types) != num_layers or any(t not in (FULL, SLIDING) for t in types):
        raise ModelError(
            f"{source}: layer_types must list {num_layers} of {FULL!r} / {SLIDING!r}, got {types!r}"
        )
    return list(types)


def build_layers(
    cfg: Mapping[str, Any],
    common: Mapping[str, Any],
    source: str,
    *,
    types: Sequence[str],
    sliding_window: int | None,
    rope_overrides: Mapping[str | None, Mapping[str, Any]] | None = None,
    rope_extra: Mapping[str, Any] | None = None,
    no_rope: Sequence[bool] | None = None,
    sparse: Sequence[bool] | None = None,
    partial_rotary_factor: float | None = None,
) -> tuple[LayerSpec, ...]:
    """The layers: ``types[i]`` (full or sliding attention, the latter of
    ``sliding_window`` positions), each type's RoPE (``rope_parameters`` per layer type,
    or one for all; ``rope_overrides`` replaces a type's fields, ``rope_extra`` adds
    fields to every type's), no RoPE where ``no_rope[i]``, routed experts where
    ``sparse[i]``."""
    n = common["num_layers"]
    if SLIDING in types and not sliding_window:
        raise ModelError(f"{source}: layers of type {SLIDING!r} need a positive sliding_window")
    by_type = rope_parameters_by_layer_type(cfg)
    by_type.update(rope_overrides or {})
    ropes: dict[str, Rope] = {}
    for kind in set(types):
        fields = by_type.get(kind, by_type.get(None))
        if fields is None:
            raise ModelError(f"{source}: rope_parameters has no entry for {kind!r} layers")
        ropes[kind] = parse_rope(
            {**fields, **(rope_extra or {})}, head_dim=common["head_dim"],
            max_position_embeddings=common["max_position_embeddings"], source=source,
            partial_rotary_factor=partial_rotary_factor,
        )  # fmt: skip
    no_rope = no_rope or [False] * n
    sparse = sparse or [False] * n
    return tuple(
        LayerSpec(
            sliding_window=sliding_window if types[i] == SLIDING else None,
            rope=None if no_rope[i] else ropes[types[i]],
            sparse=bool(sparse[i]),
        )
        for i in range(n)
    )


def optional_window(cfg: Mapping[str, Any], source: str, key: str = "sliding_window") -> int | None:
    """``cfg[key]`` as a positive window, or ``None`` when absent or null."""
    value = cfg.get(key)
    return None if value is None else positive_int(cfg, key, source)


def attention_biases(cfg: dict[str, Any]) -> dict[str, bool]:
    """``attention_bias`` as most families read it: biases on q, k, v and o, or on none."""
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}
