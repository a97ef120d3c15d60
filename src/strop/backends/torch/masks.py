"""The attention masks strop hands a ``transformers`` model for packed rows.

A packed row (:mod:`strop.batch.packing`) holds several sequences end to end, so
transformers cannot derive who sees whom from a 0/1 mask: strop builds the 4-D additive
mask itself, and transformers takes it as it is, skipping its own masks, sliding windows
included. So the windows are built in here, from the spec (each layer's
``sliding_window``, :class:`~strop.models.ModelSpec`), over the tokens' positions: a query
at position ``p`` sees the keys of its own sequence (and shared prompt) at positions
``p - window + 1 .. p`` (the JAX backend's rule too). Layers attending differently get
the masks as a dict keyed by the config's ``layer_types`` (``full_attention``,
``sliding_attention``), which the models with layer types take in place of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strop.batch.packing import PREFIX_STRIDE
from strop.errors import ModelError
from strop.models import ModelSpec


def packed_attention_mask(
    packed: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """``[B, 1, L, L]`` additive mask (0 where a query attends, the dtype's lowest
    elsewhere) of packed rows: a real token sees the tokens before it in its own segment
    and in the shared prompt its ``packed`` value names (``segment + PREFIX_STRIDE *
    prefix``, :mod:`strop.batch.packing`), those less than ``window`` positions back when
    one is given; a padding token sees every real token before it."""
    segments, prefixes = packed % PREFIX_STRIDE, packed // PREFIX_STRIDE
    real = segments > 0
    length = packed.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=packed.device).tril()
    own = (segments[:, :, None] == segments[:, None, :]) | (
        prefixes[:, :, None] == segments[:, None, :]
    )
    if window is not None:
        own &= positions[:, :, None] - positions[:, None, :] < window
    allowed = causal[None] & real[:, None, :] & (own | ~real[:, :, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=packed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def layer_type_windows(spec: ModelSpec, layer_types: Sequence[str] | None) -> dict[str, int | None]:
    """Each of the config's ``layer_types``' window (``None``: full attention), for a
    model whose layers attend over different windows."""
    if layer_types is None or len(layer_types) != len(spec.layers):
        raise ModelError(
            f"{spec.family}: layers attend over different windows but config.json's "
            "layer_types does not say which layer is which"
        )
    windows: dict[str, int | None] = {}
    for kind, layer in zip(layer_types, spec.layers, strict=True):
        if windows.setdefault(kind, layer.sliding_window) != layer.sliding_window:
            raise ModelError(f"{spec.family}: layers of type {kind!r} differ in their windows")
    return windows


def model_attention_mask(
    spec: ModelSpec,
    layer_types: Sequence[str] | None,
    packed: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` argument of a model's forward over packed rows (``[B, L]``
    segment ids and positions): :func:`packed_attention_mask` with the layers' window, or
    a dict of them by layer type (the config's ``layer_types``) when layers attend over
    different windows."""
    windows = {layer.sliding_window for layer in spec.layers}
    if len(windows) == 1:
        return packed_attention_mask(packed, positions, dtype, windows.pop())
    by_type = layer_type_windows(spec, layer_types)
    masks = {w: packed_attention_mask(packed, positions, dtype, w) for w in windows}
    return {kind: masks[window] for kind, window in by_type.items()}
