"""The protocols a backend implements. The core talks to backends only through these.

Arrays cross the boundary as numpy: the core never sees a jax or torch array.
Later issues add ``Policy`` (generate, logprobs, train_step, save/restore, export) and
``Critic`` (values, train_step) here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from strop.io.hf import ModelSpec


@runtime_checkable
class ModelHandle(Protocol):
    """A loaded causal language model, as returned by :func:`strop.load_model`."""

    backend: str
    spec: ModelSpec

    def logits(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """Float32 logits ``[B, L, V]`` for token ids ``[B, L]``.

        ``attention_mask`` (1 = real token, 0 = padding) defaults to all ones; positions
        default to counting from each row's first real token.
        """
        ...

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the model as a HF checkpoint directory that ``transformers`` loads."""
        ...
