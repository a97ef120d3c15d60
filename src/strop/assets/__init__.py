"""Files shipped inside the package: the tiny pretrained math and calculator-agent models,
and a LoRA adapter that makes the math model a better teacher.

``tiny-math/`` is a Qwen2-architecture checkpoint (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat template, and a model card
``README.md``), supervised-fine-tuned by ``scripts/train_tiny_model.py`` on the synthetic
word problems of :mod:`strop.data.synthetic`. It loads like any other checkpoint directory.

``tiny-math-teacher/`` is a PEFT LoRA adapter (``adapter_config.json``,
``adapter_model.safetensors``, a model card ``README.md``) over ``tiny-math/``, trained by
strop's own LoRA-PPO on the train problems of ``strop demo`` (``scripts/make_teacher_adapter.sh``):
the teacher of ``strop demo distill``, whose student is plain ``tiny-math/``.

``tiny-calc/`` is the same kind of checkpoint with a Qwen2.5-style tool-calling chat template,
fine-tuned by ``scripts/train_tiny_agent.py`` on calculator tool-use demonstrations
(:mod:`strop.agents.calculator_tasks`) for the ``calculator`` environment.
"""

from __future__ import annotations

import json
from pathlib import Path

from strop.errors import ModelError

TINY_MATH = "tiny-math"
TINY_MATH_TEACHER = "tiny-math-teacher"
TINY_CALC = "tiny-calc"
CHECKPOINT_FILES = ("config.json", "model.safetensors")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def tiny_math_path() -> Path:
    """The directory of the shipped tiny math model (ModelError if the install lacks it)."""
    return _asset(TINY_MATH, "math model", CHECKPOINT_FILES, "python scripts/train_tiny_model.py")


def tiny_math_teacher_path() -> Path:
    """The directory of the shipped PEFT adapter over :func:`tiny_math_path` that PPO made a
    better solver (ModelError if the install lacks it)."""
    return _asset(
        TINY_MATH_TEACHER, "math teacher adapter", ADAPTER_FILES, "scripts/make_teacher_adapter.sh"
    )


def tiny_calc_path() -> Path:
    """The directory of the shipped tiny calculator-agent model (ModelError if missing)."""
    return _asset(
        TINY_CALC, "calculator-agent model", CHECKPOINT_FILES, "python scripts/train_tiny_agent.py"
    )


def _asset(name: str, what: str, files: tuple[str, ...], remake: str) -> Path:
    path = Path(__file__).resolve().parent / name
    if not all((path / file).is_file() for file in files):
        raise ModelError(
            f"the shipped tiny {what} is missing from {path}; reinstall strop, or "
            f"regenerate it with `{remake}`"
        )
    return path


def teacher_accuracy(seed: int) -> float | None:
    """The teacher's (tiny-math + :func:`tiny_math_teacher_path`) greedy accuracy on the
    held-out problems ``strop demo`` writes for ``seed``, as its model card measured it
    (``accuracy.json``); None for another seed (other problems: not measured)."""
    measured = json.loads((tiny_math_teacher_path() / "accuracy.json").read_text())
    return float(measured["accuracy"]) if measured["seed"] == seed else None
