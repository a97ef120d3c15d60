"""Files shipped inside the package: the tiny pretrained math model.

``tiny-math/`` is a Qwen2-architecture checkpoint (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat template, and a model card
``README.md``), supervised-fine-tuned by ``scripts/train_tiny_model.py`` on the synthetic
word problems of :mod:`strop.data.synthetic`. It loads like any other checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path

from strop.errors import ModelError

TINY_MATH = "tiny-math"


def tiny_math_path() -> Path:
    """The directory of the shipped tiny math model (ModelError if the install lacks it)."""
    path = Path(__file__).resolve().parent / TINY_MATH
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelError(
            f"the shipped tiny math model is missing from {path}; reinstall strop, or "
            "regenerate it with `python scripts/train_tiny_model.py`"
        )
    return path
