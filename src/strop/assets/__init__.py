"""Files shipped inside the package: the tiny pretrained math and calculator-agent models.

``tiny-math/`` is a Qwen2-architecture checkpoint (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat template, and a model card
``README.md``), supervised-fine-tuned by ``scripts/train_tiny_model.py`` on the synthetic
word problems of :mod:`strop.data.synthetic`. It loads like any other checkpoint directory.

``tiny-calc/`` is the same kind of checkpoint with a Qwen2.5-style tool-calling chat template,
fine-tuned by ``scripts/train_tiny_agent.py`` on calculator tool-use demonstrations
(:mod:`strop.agents.calculator_tasks`) for the ``calculator`` environment.
"""

from __future__ import annotations

from pathlib import Path

from strop.errors import ModelError

TINY_MATH = "tiny-math"
TINY_CALC = "tiny-calc"


def tiny_math_path() -> Path:
    """The directory of the shipped tiny math model (ModelError if the install lacks it)."""
    return _asset(TINY_MATH, "math", "train_tiny_model.py")


def tiny_calc_path() -> Path:
    """The directory of the shipped tiny calculator-agent model (ModelError if missing)."""
    return _asset(TINY_CALC, "calculator-agent", "train_tiny_agent.py")


def _asset(name: str, what: str, script: str) -> Path:
    path = Path(__file__).resolve().parent / name
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ModelError(
            f"the shipped tiny {what} model is missing from {path}; reinstall strop, or "
            f"regenerate it with `python scripts/{script}`"
        )
    return path
