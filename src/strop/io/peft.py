"""LoRA adapters in the Hugging Face PEFT format (backend-neutral, numpy).

A directory with ``adapter_config.json`` and ``adapter_model.safetensors`` holding
``base_model.model.<module>.lora_A.weight [r, in]`` and ``...lora_B.weight [out, r]``.
``target_modules`` is written as one regex string, which PEFT matches with
``re.fullmatch`` against module names: exactly strop's semantics.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from strop.config import LoraConfig
from strop.errors import CheckpointError, ConfigError
from strop.io.atomic import atomic_directory
from strop.io.hf import open_safetensors
from strop.io.model_spec import read_model_spec
from strop.io.untrusted import read_json, shown_name
from strop.io.writable import writing
from strop.models import ModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_ADAPTER_WEIGHTS = "adapter_model.bin"
# Upper bounds on what adapter_config.json may claim, whatever the base model: a rank no
# base model strop supports needs (the real check is against the model's hidden size),
# and target patterns far longer than any module path.
MAX_RANK = 65536
MAX_ALPHA = 1e9
MAX_PATTERN_CHARS = 1000
_PREFIX = "base_model.model."
_SUFFIXES = {"A": ".lora_A.weight", "B": ".lora_B.weight"}

AdapterWeights = dict[str, tuple[np.ndarray, np.ndarray]]


def target_regex(patterns: list[str]) -> str:
    """One regex equivalent (under ``re.fullmatch``) to matching any of ``patterns``."""
    return patterns[0] if len(patterns) == 1 else "|".join(f"(?:{p})" for p in patterns)


def peft_tensors(weights: AdapterWeights) -> dict[str, np.ndarray]:
    """``weights`` under PEFT's tensor names (what ``adapter_model.safetensors`` holds)."""
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[_PREFIX + module + _SUFFIXES["A"]] = np.ascontiguousarray(a)
        tensors[_PREFIX + module + _SUFFIXES["B"]] = np.ascontiguousarray(b)
    return tensors


def peft_config(
    *, rank: int, alpha: float, dropout: float, target_modules: list[str], base_model: str | None
) -> dict[str, Any]:
    """What ``adapter_config.json`` holds for a strop adapter."""
    return {
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
    tensors = peft_tensors(weights)
    config = peft_config(
        rank=rank, alpha=alpha, dropout=dropout, target_modules=target_modules,
        base_model=base_model,
    )  # fmt: skip
    with writing("the adapter", target), atomic_directory(target, overwrite=overwrite) as staging:
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return target


def adapter_lora(lora: LoraConfig, path: str | os.PathLike, spec: ModelSpec) -> LoraConfig:
    """``lora`` describing the PEFT adapter at ``path`` (its r, alpha and targets), checked
    against the base model's ``spec`` (:func:`load_adapter`) before its shape sizes the
    model built for it: what a model that loads the adapter is built with."""
    adapter_config, _ = load_adapter(path, spec)
    targets = adapter_config.get("target_modules")
    return lora.model_copy(
        update={
            "enabled": True,
            "rank": adapter_config["r"],
            "alpha": float(adapter_config.get("lora_alpha", adapter_config["r"])),
            "target_modules": peft_target_patterns(targets),
            "dropout": 0.0,
        }
    )


def peft_target_patterns(targets: str | Iterable[str]) -> list[str]:
    """PEFT's ``target_modules`` as the full-match patterns ``lora.target_modules`` takes:
    a string is already one (PEFT matches it with ``re.fullmatch``); a list names modules
    by their last part (PEFT matches a name or a dotted suffix: ``q_proj`` is
    ``model.layers.0.self_attn.q_proj``)."""
    if isinstance(targets, str):
        return [targets]
    return [rf"(.*\.)?{re.escape(name)}" for name in sorted(targets)]


def load_adapter(
    path: str | os.PathLike, spec: ModelSpec | None = None
) -> tuple[dict[str, Any], AdapterWeights]:
    """Read and validate a PEFT LoRA adapter directory: (config, weights by module).

    ``adapter_config.json`` and the safetensors header are checked before any tensor is
    read: a LoRA config strop can apply, plain module names, float dtypes, and A ``[r, in]``
    / B ``[out, r]`` for every module. With ``spec`` (the base model) each module must be
    one of its linear layers with those ``in`` / ``out`` sizes, and ``r`` at most its
    hidden size. Every problem is a :class:`CheckpointError` naming the file.
    """
    directory = Path(path)
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not directory.is_dir():
        raise CheckpointError(f"adapter path {str(directory)!r} is not a directory")
    if not weights_path.is_file() and (directory / PICKLE_ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(
            f"{directory}: has {PICKLE_ADAPTER_WEIGHTS} but no {ADAPTER_WEIGHTS}; strop reads "
            "adapters only from safetensors (pickle files can run code)"
        )
    if not config_path.is_file() or not weights_path.is_file():
        raise CheckpointError(
            f"{directory}: not a PEFT adapter (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    config = read_adapter_config(config_path)
    rank = config["r"]
    if spec is not None and rank > spec.hidden_size:
        raise CheckpointError(
            f"{config_path}: r={rank} is larger than the base model's hidden_size="
            f"{spec.hidden_size}"
        )
    handle = open_safetensors(weights_path, CheckpointError)
    pairs: dict[str, dict[str, str]] = {}
    for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
        for kind, suffix in _SUFFIXES.items():
            if name.startswith(_PREFIX) and name.endswith(suffix):
                module = name[len(_PREFIX) : -len(suffix)]
                pairs.setdefault(module, {})[kind] = name
                break
        else:
            raise CheckpointError(
                f"{weights_path}: unexpected tensor {shown_name(name)} (a LoRA adapter holds "
                f"only {_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
            )
    if not pairs:
        raise CheckpointError(f"{weights_path}: holds no LoRA tensors")
    base = config.get("base_model_name_or_path")
    made_for = f" (was it made for another base model? it names {base!r})" if base else ""
    for module, pair in sorted(pairs.items()):
        if "A" not in pair or "B" not in pair:
            raise CheckpointError(f"{weights_path}: {module} needs both lora_A and lora_B")
        a = tuple(handle.get_slice(pair["A"]).get_shape())
        b = tuple(handle.get_slice(pair["B"]).get_shape())
        if len(a) != 2 or len(b) != 2:
            raise CheckpointError(
                f"{weights_path}: {module} needs 2-D lora_A and lora_B, got A {list(a)}, "
                f"B {list(b)}"
            )
        if a[0] != rank or b[1] != rank:
            raise CheckpointError(
                f"{weights_path}: {module} has A {list(a)}, B {list(b)}; expected rank r={rank}"
            )
        if spec is not None and spec.registered:  # else transformers' class knows its linears
            linear = spec.linear_shape(module)
            if linear is None:
                raise CheckpointError(
                    f"{weights_path}: {module} is not a linear layer of the base model" + made_for
                )
            out_features, in_features = linear
            if (b[0], a[1]) != (out_features, in_features):
                raise CheckpointError(
                    f"{weights_path}: {module} has A {list(a)}, B {list(b)}; the base model "
                    f"needs A [{rank}, {in_features}], B [{out_features}, {rank}]" + made_for
                )
    weights: AdapterWeights = {}
    for module, pair in pairs.items():
        try:
            weights[module] = (handle.get_tensor(pair["A"]), handle.get_tensor(pair["B"]))
        except SafetensorError as err:
            raise CheckpointError(f"{weights_path}: cannot read {module} ({err})") from None
    return config, weights


def read_adapter_config(config_path: Path) -> dict[str, Any]:
    """``adapter_config.json``, checked to be a LoRA config strop applies as PEFT would."""
    config = read_json(config_path, CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")

    def bad(key: str, what: str) -> CheckpointError:
        value = repr(config.get(key))
        value = value if len(value) <= 60 else value[:55] + "..."
        return CheckpointError(f"{config_path}: {key} must be {what}, got {value}")

    if config.get("peft_type") != "LORA":
        raise bad("peft_type", '"LORA" (the only adapter type strop applies)')
    rank = config.get("r")
    if not _is_int(rank) or rank < 1:
        raise bad("r", "a positive integer")
    if rank > MAX_RANK:
        raise bad("r", f"at most {MAX_RANK}")
    alpha = config.get("lora_alpha", rank)
    if not _is_number(alpha) or not 0 < alpha <= MAX_ALPHA:
        raise bad("lora_alpha", f"a positive number (at most {MAX_ALPHA:g})")
    targets = config.get("target_modules")
    patterns = [targets] if isinstance(targets, str) else targets
    if not isinstance(patterns, list) or not patterns:
        raise bad("target_modules", "a module-name regex or a non-empty list of them")
    for pattern in patterns:
        if not isinstance(pattern, str) or not _plain_pattern(pattern):
            raise CheckpointError(
                f"{config_path}: target_modules entry {shown_name(str(pattern), 60)} is not a "
                "module name or regex (no '/' or control characters; at most "
                f"{MAX_PATTERN_CHARS} characters)"
            )
        try:
            re.compile(pattern)
        except re.error as err:
            raise CheckpointError(
                f"{config_path}: target_modules entry {shown_name(pattern, 60)} is not a "
                f"valid regex ({err})"
            ) from None
    if config.get("use_rslora") or config.get("use_dora"):
        raise CheckpointError(f"{config_path}: rsLoRA and DoRA adapters are not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise CheckpointError(
                f"{config_path}: {key} is not supported (strop applies one "
                "rank and alpha to every targeted module)"
            )
    if config.get("fan_in_fan_out"):
        raise CheckpointError(f"{config_path}: fan_in_fan_out=true is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise bad("bias", '"none" (strop adapters carry no bias terms)')
    return config


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _plain_pattern(pattern: str) -> bool:
    """A module name or regex: not a path, no control characters, not absurdly long."""
    return 0 < len(pattern) <= MAX_PATTERN_CHARS and "/" not in pattern and pattern.isprintable()


def read_adapter_for(
    path: str | os.PathLike, lora: LoraConfig, base_model: str | os.PathLike
) -> AdapterWeights:
    """The weights of the adapter at ``path``, checked against a run's ``lora:`` section
    and, before any tensor is read, against the shapes of ``base_model``'s linear layers
    (the check ``strop eval`` applies to ``eval.adapter``)."""
    if not lora.enabled:
        raise ConfigError("lora.restore_path is set but lora.enabled is false")
    config_path = Path(path) / ADAPTER_CONFIG
    rank = read_adapter_config(config_path)["r"] if config_path.is_file() else lora.rank
    if rank != lora.rank:  # before any tensor is read
        raise ConfigError(
            f"lora.restore_path {path}: adapter rank r={rank} differs from lora.rank={lora.rank}"
        )
    return load_adapter(path, read_model_spec(base_model))[1]


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


def write_adapter_once(
    path: str | os.PathLike,
    gather: Callable[[], AdapterWeights],
    lora: LoraConfig,
    *,
    base_model: str | os.PathLike,
    write_once: Callable[[Callable[[], object], str], None],
    overwrite: bool = False,
) -> Path:
    """Export a run's adapter as a PEFT directory, called on every process: each gathers
    the weights (``gather``, collective), the main one writes them (``write_once``, the
    backend's) and every process returns once the directory is complete."""
    if not lora.enabled:
        raise ConfigError("export --adapter needs lora.enabled=true")
    weights = gather()
    write_once(
        lambda: save_adapter_for(path, weights, lora, base_model=base_model, overwrite=overwrite),
        f"writing the adapter {path}",
    )
    return Path(path)


def check_adapter_targets(weights: AdapterWeights, modules: Iterable[str], source: str) -> None:
    """Refuse adapter ``weights`` (from ``source``) unless they are for exactly the model's
    LoRA ``modules`` (module paths)."""
    modules = set(modules)
    if set(weights) != modules:
        missing, extra = sorted(modules - set(weights)), sorted(set(weights) - modules)
        raise ConfigError(
            f"{source}: adapter targets do not match lora.target_modules "
            f"(missing: {missing[:6]}, unexpected: {extra[:6]})"
        )


def check_adapter_shape(
    source: str, path: str, shape: Sequence[int], expected: Sequence[int]
) -> None:
    """Refuse an adapter tensor (of module ``path``, from ``source``) whose PEFT-layout
    ``shape`` is not the ``expected`` one."""
    if tuple(shape) != tuple(expected):
        raise ConfigError(
            f"{source}: adapter for {path} has shape {list(shape)}, the model "
            f"expects {list(expected)} (is lora.rank the adapter's rank?)"
        )
