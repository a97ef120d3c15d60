"""strop: post-training for language models (LoRA fine-tuning, PPO with a critic) on JAX and torch."""

from __future__ import annotations

from strop.api import load_model
from strop.errors import StropError

__version__ = "0.1.0.dev0"
__all__ = ["StropError", "__version__", "load_model"]
