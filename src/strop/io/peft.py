"""LoRA adapters in the Hugging Face PEFT format (backend-neutral, numpy).

A directory with ``adapter_config.json`` and ``adapter_model.safetensors`` holding
``base_model.model.<module>.lora_A.weight [r, in]`` and ``...lora_B.weight [out, r]``.
``target_modules`` is written as one regex string, which PEFT matches with
``re.fullmatch`` against module names: exactly strop's semantics.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from strop.config import LoraConfig
from strop.errors import CheckpointError, ConfigError
from strop.io.atomic import atomic_directory

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {"A": ".lora_A.weight", "B": ".lora_B.weight"}

AdapterWeights = dict[str, tuple[np.ndarray, np.ndarray]]


def target_regex(patterns: list[str]) -> str:
    """One regex equivalent (under ``re.fullmatch``) to matching any of ``patterns``."""
    return patterns[0] if len(patterns) == 1 else "|".join(f"(?:{p})" for p in patterns)


def save_adapter(
    path: str | os.PathLike,
    weights: AdapterWeights,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    base_model: str | None,
    overwrite: bool = False,
) -> Path:
    """Write a PEFT LoRA adapter directory; it appears only when complete.

    An existing non-empty ``path`` is replaced only with ``overwrite``.
    """
    target = Path(path)
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[_PREFIX + module + _SUFFIXES["A"]] = np.ascontiguousarray(a)
        tensors[_PREFIX + module + _SUFFIXES["B"]] = np.ascontiguousarray(b)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": target_regex(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model,
        "inference_mode": True,
    }
    with atomic_directory(target, overwrite=overwrite) as staging:
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return target


def load_adapter(path: str | os.PathLike) -> tuple[dict[str, Any], AdapterWeights]:
    """Read and validate a PEFT LoRA adapter directory: (config, weights by module)."""
    directory = Path(path)
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise CheckpointError(
            f"{directory}: not a PEFT adapter (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise CheckpointError(f"{config_path}: peft_type must be LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if config.get("use_rslora") or config.get("use_dora"):
        raise CheckpointError(f"{config_path}: rsLoRA and DoRA adapters are not supported")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights_path}: cannot read safetensors ({err})") from None
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        for kind, suffix in _SUFFIXES.items():
            if name.startswith(_PREFIX) and name.endswith(suffix):
                module = name[len(_PREFIX) : -len(suffix)]
                pairs.setdefault(module, {})[kind] = value
                break
        else:
            raise CheckpointError(f"{weights_path}: unexpected tensor {name!r}")
    weights: AdapterWeights = {}
    for module, pair in pairs.items():
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.ndim != 2 or b.ndim != 2:
            raise CheckpointError(f"{weights_path}: {module} needs 2-D lora_A and lora_B")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise CheckpointError(
                f"{weights_path}: {module} has A {list(a.shape)}, B {list(b.shape)}; "
                f"expected rank r={rank}"
            )
        weights[module] = (a, b)
    return config, weights


def read_adapter_for(path: str | os.PathLike, lora: LoraConfig) -> AdapterWeights:
    """The weights of the adapter at ``path``, checked against a run's ``lora:`` section."""
    if not lora.enabled:
        raise ConfigError("lora.restore_path is set but lora.enabled is false")
    adapter_config, weights = load_adapter(path)
    if adapter_config["r"] != lora.rank:
        raise ConfigError(
            f"lora.restore_path {path}: adapter rank r={adapter_config['r']} differs from "
            f"lora.rank={lora.rank}"
        )
    return weights


def save_adapter_for(
    path: str | os.PathLike,
    weights: AdapterWeights,
    lora: LoraConfig,
    *,
    base_model: str | os.PathLike,
    overwrite: bool = False,
) -> Path:
    """:func:`save_adapter` with a run's ``lora:`` section."""
    if not lora.enabled:
        raise ConfigError("export --adapter needs lora.enabled=true")
    return save_adapter(
        path,
        weights,
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        target_modules=lora.target_modules,
        base_model=str(Path(base_model).absolute()),
        overwrite=overwrite,
    )
