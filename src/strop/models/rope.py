"""Rotary position embeddings as a ``config.json`` declares them: :class:`Rope`, parsed
from either transformers 5's ``rope_parameters`` (one dict, or one per layer type) or the
older top-level ``rope_theta`` + ``rope_scaling``.

Backend-neutral: the numbers (inverse frequencies, attention factors) are the backends'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strop.errors import ModelError

ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
"""The RoPE types strop parses (transformers' ``rope_type``); the JAX backend says which
of them its decoder computes (``backends/jax/rope.py``)."""

_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "dynamic": ("factor",),
}
_NOT_SCALING = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


@dataclass(frozen=True)
class Rope:
    """One layer type's RoPE: its ``kind`` (transformers' ``rope_type``), base ``theta``,
    the dims it rotates (``rotary_dim``: ``head_dim`` x ``partial_rotary_factor``), the
    kind's own fields as given (``scaling``: factor, low/high_freq_factor, short/long_factor,
    beta_fast, ...) and the model's ``max_position_embeddings`` (which yarn, longrope and
    dynamic read)."""

    kind: str
    theta: float
    rotary_dim: int
    max_position_embeddings: int
    scaling: tuple[tuple[str, Any], ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        """The scaling field ``name`` (lists come back as tuples), else ``default``."""
        return dict(self.scaling).get(name, default)

    def parameters(self) -> dict[str, Any]:
        """The ``rope_parameters`` dict transformers reads for this layer type."""
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in self.scaling}
        return {"rope_type": self.kind, "rope_theta": self.theta, **fields}


def rope_parameters_by_layer_type(cfg: Mapping[str, Any]) -> dict[str | None, dict[str, Any]]:
    """The RoPE fields of each layer type (``full_attention``, ``sliding_attention``),
    or under ``None`` when every layer shares one dict: transformers 5's
    ``rope_parameters`` as written, else the older top-level ``rope_theta`` (default
    10000) updated with ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if (
        isinstance(params, Mapping)
        and params
        and all(isinstance(v, Mapping) for v in params.values())
    ):
        return {key: dict(value) for key, value in params.items()}
    merged: dict[str, Any] = {"rope_theta": cfg.get("rope_theta", 10000.0)}
    if isinstance(params, Mapping):
        merged.update(params)
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping):  # transformers 5 takes it over rope_parameters too
        merged.update(scaling)
    return {None: merged}


def parse_rope(
    fields: Mapping[str, Any],
    *,
    head_dim: int,
    max_position_embeddings: int,
    source: str,
    partial_rotary_factor: float | None = None,
) -> Rope:
    """A :class:`Rope` from one layer type's fields; a kind strop does not know, or one
    missing a field its formula needs, is a one-line :class:`ModelError`."""
    kind = fields.get("rope_type", fields.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ModelError(
            f"{source}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_KINDS)}"
        )
    missing = [name for name in _REQUIRED[kind] if name not in fields]
    if missing:
        raise ModelError(f"{source}: rope type {kind!r} needs {', '.join(missing)}")
    factor = fields.get("partial_rotary_factor", partial_rotary_factor)
    factor = 1.0 if factor is None else float(factor)
    if not 0.0 < factor <= 1.0:
        raise ModelError(f"{source}: partial_rotary_factor must be in (0, 1], got {factor}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ModelError(
            f"{source}: partial_rotary_factor={factor} gives {rotary_dim} rotary dims of "
            f"head_dim={head_dim}; they must be even and at least 2"
        )
    for name in ("short_factor", "long_factor") if kind == "longrope" else ():
        given = fields[name]
        if not isinstance(given, list | tuple) or len(given) != rotary_dim // 2:
            raise ModelError(
                f"{source}: longrope {name} needs one number per rotary frequency "
                f"({rotary_dim // 2}), got {given!r:.60}"
            )
    scaling = tuple(
        (key, tuple(value) if isinstance(value, list) else value)
        for key, value in sorted(fields.items())
        if key not in _NOT_SCALING and value is not None
    )
    try:
        theta = float(fields.get("rope_theta", 10000.0))
    except (TypeError, ValueError):
        raise ModelError(f"{source}: rope_theta must be a number") from None
    return Rope(kind, theta, rotary_dim, max_position_embeddings, scaling)
