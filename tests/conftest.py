"""Shared test set-up.

JAX sees 8 CPU devices in every test (set before jax is first imported), so multi-device
meshes need no separate process; single-device tests build a 1-device mesh explicitly.
Tiny Hugging Face models are built here with ``transformers`` and random weights: nothing
is downloaded.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(kind)`` -> path of a saved tiny HF model (cached per session)."""
    cache: dict[str, str] = {}

    def make(kind: str) -> str:
        if kind not in cache:
            cache[kind] = str(save_tiny_model(kind, tmp_path_factory.mktemp(kind)))
        return cache[kind]

    return make
