"""The torch backend's :class:`~strop.backends.base.ModelHandle`."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from strop.backends.base import ModelHandle
from strop.backends.torch.fsdp import place, write_once
from strop.backends.torch.model import LoadedModel, build_model, forward_logits, hf_weights
from strop.config import Config, MeshConfig
from strop.io.hf import write_checkpoint_once
from strop.models import ModelSpec
from strop.quantization import say_merged_export_dequantizes


class TorchModelHandle(ModelHandle):
    """A ``transformers`` model (FSDP2-sharded under ``torchrun``), numpy in and out."""

    backend = "torch"

    def __init__(self, loaded: LoadedModel, source_dir: Path | None = None):
        self.loaded = loaded
        self.source_dir = source_dir

    @property
    def spec(self) -> ModelSpec:
        return self.loaded.spec

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @torch.no_grad()
    def forward(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Float32 logits of checked arrays (:meth:`ModelHandle.logits`)."""
        device = self.loaded.placement.device
        arrays = (torch.from_numpy(a).to(device) for a in (ids, mask, positions))
        return forward_logits(self.loaded, *arrays).cpu().numpy()

    def save(
        self, path: str | os.PathLike, *, overwrite: bool = False, max_shard_bytes: int = 4 << 30
    ) -> Path:
        return save_hf_model(
            self.loaded,
            path,
            source_dir=self.source_dir,
            overwrite=overwrite,
            max_shard_bytes=max_shard_bytes,
        )


def save_hf_model(
    loaded: LoadedModel,
    path: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None,
    lora_scale: float | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write the model (adapters merged with ``lora_scale``) as a HF checkpoint.

    Every rank takes part in gathering the shards; rank 0 writes, and every rank returns
    once the directory is complete.
    """
    dtype_name = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    return write_checkpoint_once(
        path,
        loaded.spec.raw,
        hf_weights(loaded, lora_scale=lora_scale),
        is_main=loaded.placement.is_main,
        write_once=write_once,
        dtype_name=dtype_name,
        source_dir=source_dir,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )


def _lora_scale(config: Config) -> float | None:
    return config.lora.alpha / config.lora.rank if config.lora.enabled else None


def export_merged(
    loaded: LoadedModel, path: str | os.PathLike, config: Config, *, overwrite: bool = False
) -> Path:
    """``loaded``, fine-tuned under ``config``, as a HF checkpoint beside its base model's
    files: the default adapter folded in (scaled ``lora.alpha / lora.rank``), or the full
    model. A quantized base (``lora.base_quantization``) is written dequantized."""
    say_merged_export_dequantizes(config)
    return save_hf_model(
        loaded, path, source_dir=config.model.path, lora_scale=_lora_scale(config),
        overwrite=overwrite,
    )  # fmt: skip


def merged_weights(loaded: LoadedModel, config: Config) -> Iterator[tuple[str, np.ndarray]]:
    """What :func:`export_merged` writes, as (HF name, host array) pairs, one at a time."""
    return hf_weights(loaded, lora_scale=_lora_scale(config))


def load_model(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    mesh: MeshConfig | Mapping[str, int] | None = None,
) -> TorchModelHandle:
    """Load a HF checkpoint directory; sharded with FSDP2 when launched under ``torchrun``."""
    if not isinstance(mesh, MeshConfig):
        mesh = MeshConfig(**(mesh or {}))
    loaded = build_model(path, place(mesh), dtype=dtype, param_dtype=param_dtype)
    return TorchModelHandle(loaded, source_dir=Path(path))
