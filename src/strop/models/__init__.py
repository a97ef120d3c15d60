"""The model-family registry: for each decoder family strop knows, how its
``config.json`` parses into a :class:`~strop.models.spec.ModelSpec` (the common decoder's
sizes plus the ways the family's differs) and which transformers class builds it.

A family is one module of :mod:`strop.models.families` that defines ``FAMILIES`` (usually
one :class:`Family`); the registry finds them itself, so a new dense family is that
module plus its parity test (docs/models.md). A ``model_type`` no family declares is
read from the common keys as an unregistered decoder: the torch backend builds
transformers' own class for it, the JAX backend refuses it in one line.

Backend-neutral: nothing here imports an array framework.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from strop.errors import ModelError
from strop.models.parsing import FULL, SLIDING, common_fields, optional_window
from strop.models.rope import Rope
from strop.models.spec import LayerSpec, ModelSpec, MoeSpec

__all__ = ["Family", "LayerSpec", "ModelSpec", "MoeSpec", "Rope", "parse_config", "registry"]


@dataclass(frozen=True)
class Family:
    """One decoder family: its ``model_type``, the transformers class that builds it
    (``architecture``), a one-line ``summary`` (docs, errors), and ``fields``: given the raw
    config, the common fields (:func:`~strop.models.parsing.common_fields`) and the
    config's path, the family's own :class:`ModelSpec` fields (``layers`` at least).
    ``fields`` refuses, naming the flag, what the family's decoder does not declare."""

    model_type: str
    architecture: str
    summary: str
    fields: Callable[[Mapping[str, Any], Mapping[str, Any], str], dict[str, Any]]


@functools.cache
def registry() -> dict[str, Family]:
    """Every registered family by ``model_type`` (each module of
    :mod:`strop.models.families` contributes its ``FAMILIES``)."""
    from strop.models import families as package

    found: dict[str, Family] = {}
    for module_info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{module_info.name}")
        for family in module.FAMILIES:
            if family.model_type in found:
                raise RuntimeError(f"model_type {family.model_type!r} registered twice")
            found[family.model_type] = family
    return found


def parse_config(cfg: Mapping[str, Any], *, source: str = "config.json") -> ModelSpec:
    """A HF config dict as a :class:`ModelSpec`, by its ``model_type``'s family; a
    ``model_type`` no family declares gives an unregistered spec (``registered=False``)."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelError(f"{source}: no model_type; is this a transformers config.json?")
    family = registry().get(model_type)
    if family is None:
        return _unregistered(cfg, source)
    common = common_fields(cfg, source)
    return ModelSpec(
        family=model_type, architecture=family.architecture,
        **common, **family.fields(cfg, common, source),
    )  # fmt: skip


_COMMON_ALIASES = {  # older architectures' names for the common keys (GPT-2, Falcon, OPT)
    "hidden_size": ("n_embd", "d_model"),
    "num_hidden_layers": ("n_layer", "num_layers"),
    "num_attention_heads": ("n_head", "num_heads"),
    "intermediate_size": ("n_inner", "ffn_dim"),
    "max_position_embeddings": ("n_positions",),
}


def _unregistered(cfg: Mapping[str, Any], source: str) -> ModelSpec:
    """A decoder no family declares, read from the common keys or their older names
    (transformers' own class knows the rest): enough for the torch backend, `strop plan`
    and the checks on sizes. A missing MLP width is taken as 4 x hidden (GPT-2's rule)."""
    named = dict(cfg)
    for key, aliases in _COMMON_ALIASES.items():
        if named.get(key) is None:
            named[key] = next((cfg[a] for a in aliases if cfg.get(a) is not None), None)
    if named.get("intermediate_size") is None and isinstance(named.get("hidden_size"), int):
        named["intermediate_size"] = 4 * named["hidden_size"]
    try:
        common = common_fields(named, source)
    except ModelError as err:
        known = ", ".join(sorted(registry()))
        raise ModelError(
            f"{err} (model_type {cfg['model_type']!r} is not a family strop declares: {known})"
        ) from None
    architectures = cfg.get("architectures") or [f"{cfg['model_type']} (AutoModelForCausalLM)"]
    return ModelSpec(
        family=cfg["model_type"], architecture=str(architectures[0]),
        layers=_unregistered_layers(cfg, common["num_layers"], source), registered=False,
        **{**common, "raw": dict(cfg)},
    )  # fmt: skip


def _unregistered_layers(cfg: Mapping[str, Any], layers: int, source: str) -> tuple[LayerSpec, ...]:
    """An undeclared decoder's attention windows, by transformers' conventions: a layer
    listed as ``sliding_attention`` in ``layer_types`` attends over ``sliding_window``
    positions; without ``layer_types``, every layer does when ``sliding_window`` is set
    (unless ``use_sliding_window`` is false). The torch backend builds them into its masks,
    which replace transformers' own. RoPE is transformers' business here (``None``)."""
    window = optional_window(cfg, source) if cfg.get("use_sliding_window", True) else None
    types = cfg.get("layer_types") or [SLIDING if window else FULL] * layers
    if len(types) != layers:
        raise ModelError(f"{source}: layer_types must list {layers} layers, got {len(types)}")
    if SLIDING in types and window is None:
        raise ModelError(f"{source}: layers of type {SLIDING!r} need a positive sliding_window")
    return tuple(
        LayerSpec(sliding_window=window if kind == SLIDING else None, rope=None) for kind in types
    )
