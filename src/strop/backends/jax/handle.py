"""The JAX backend's :class:`~strop.backends.base.ModelHandle`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from strop.backends.base import ModelHandle
from strop.backends.jax.model import CausalLM
from strop.backends.jax.sharding import make_mesh, put_rows, to_host
from strop.backends.jax.weights import load_hf_model, save_hf_model
from strop.models import ModelSpec


@nnx.jit
def _logits(model: CausalLM, input_ids, attention_mask, positions) -> jax.Array:
    return model(input_ids, attention_mask, positions).logits


class JaxModelHandle(ModelHandle):
    """A :class:`CausalLM` on a mesh, with numpy in and out."""

    backend = "jax"

    def __init__(self, model: CausalLM, mesh: Mesh, source_dir: Path | None = None):
        self.model = model
        self.mesh = mesh
        self.source_dir = source_dir

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    def _put(self, array: np.ndarray) -> jax.Array:
        return put_rows(array, self.mesh)

    def forward(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Float32 logits of checked arrays (:meth:`ModelHandle.logits`), on the mesh."""
        arrays = (self._put(a.astype(np.int32)) for a in (ids, mask, positions))
        return to_host(_logits(self.model, *arrays)).astype(np.float32)

    def save(
        self, path: str | os.PathLike, *, overwrite: bool = False, max_shard_bytes: int = 4 << 30
    ) -> Path:
        return save_hf_model(
            self.model,
            path,
            source_dir=self.source_dir,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
        )


def load_model(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    mesh: Mesh | Mapping[str, int] | None = None,
) -> JaxModelHandle:
    """Load a HF checkpoint directory onto ``mesh`` (a ``Mesh`` or axis sizes)."""
    if not isinstance(mesh, Mesh):
        mesh = make_mesh(mesh)
    model = load_hf_model(path, mesh, dtype=dtype, param_dtype=param_dtype)
    return JaxModelHandle(model, mesh, source_dir=Path(path))
