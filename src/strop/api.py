"""The public Python API. Imports no framework until a backend is asked for."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from strop.backends import get_backend
from strop.backends.base import ModelHandle


def load_model(
    path: str | os.PathLike,
    backend: str = "jax",
    *,
    dtype: str = "float32",
    param_dtype: str | None = None,
    mesh: Any | Mapping[str, int] | None = None,
) -> ModelHandle:
    """Load a Hugging Face checkpoint directory (Qwen2/Qwen2.5, Llama 2/3) on a backend.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or a sharded index).
      backend: ``"jax"`` or ``"torch"``.
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"``.
      param_dtype: storage dtype of the weights; defaults to ``dtype``.
      mesh: where to place the weights: a backend mesh object, or axis sizes such as
        ``{"fsdp": 4, "tensor": 2}`` (``-1`` = the remaining devices); default: FSDP over
        all devices.

    Returns:
      A :class:`~strop.backends.base.ModelHandle`; ``handle.logits(ids, mask)`` gives a
      numpy ``[B, L, V]`` array.
    """
    return get_backend(backend).load_model(
        path, dtype=dtype, param_dtype=param_dtype or dtype, mesh=mesh
    )
