"""Hugging Face checkpoint directories: the model spec, reading and writing safetensors.

Backend-neutral (numpy only). A checkpoint directory holds ``config.json`` and either
``model.safetensors`` or a sharded set named by ``model.safetensors.index.json``. The
backends turn a :class:`ModelSpec` into a model and move tensors between a
:class:`SafetensorsReader` and their own parameter layout.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from strop.errors import ModelError
from strop.io.atomic import atomic_directory

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Files a checkpoint directory may carry besides the weights; copied along on save.
SIDECAR_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)

_SUPPORTED_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Tensors some checkpoints carry that are recomputed, never loaded.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``linear`` or ``llama3`` (Llama 3.1+)."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a Qwen2/Llama decoder, parsed from a HF ``config.json``.

    One dataclass for both families: Qwen2 is Llama with biases on q/k/v.
    ``raw`` keeps the original config so a saved checkpoint round-trips unchanged.
    """

    model_type: Literal["qwen2", "llama"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def architecture(self) -> str:
        """The transformers class name, e.g. ``Qwen2ForCausalLM``."""
        return _SUPPORTED_MODEL_TYPES[self.model_type]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, source: str = "config.json") -> ModelSpec:
        """Parse a HF config dict; raise :class:`ModelError` for anything unsupported."""
        model_type = cfg.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"{source}: model_type {model_type!r} is not supported; strop supports "
                f"{', '.join(sorted(_SUPPORTED_MODEL_TYPES))} (Qwen2/Qwen2.5, Llama 2/3)"
            )
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ModelError(
                    f"{source}: {key} must be a positive integer, got {cfg.get(key)!r}"
                )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if cfg.get("mlp_bias"):
            raise ModelError(f"{source}: mlp_bias=true is not supported")
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise ModelError(f"{source}: use_sliding_window=true is not supported")

        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        head_dim = cfg.get("head_dim") or hidden // heads
        theta, scaling = _parse_rope(cfg, source)
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 always has q/k/v biases; Llama's attention_bias covers q/k/v/o.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=dict(cfg),
        )


def _parse_rope(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either the transformers-5 ``rope_parameters`` layout or
    the older top-level ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{source}: rope type {kind!r} is not supported; supported: "
            f"{', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "default":
        return float(theta), None
    fields = {"kind": kind, "factor": float(scaling["factor"])}
    for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if name in scaling:
            fields[name] = scaling[name]
    return float(theta), RopeScaling(**fields)


def read_model_spec(path: str | os.PathLike) -> ModelSpec:
    """Read ``config.json`` from a checkpoint directory into a :class:`ModelSpec`."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelError(f"model path {str(directory)!r} is not a directory")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ModelError(f"{config_path}: not found; a HF checkpoint directory needs config.json")
    try:
        cfg = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelError(f"{config_path}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{config_path}: expected a JSON object")
    return ModelSpec.from_hf_config(cfg, source=str(config_path))


class SafetensorsReader:
    """Read tensors by name from a checkpoint directory, one tensor at a time, as numpy.

    Handles a single ``model.safetensors`` and a sharded ``model.safetensors.index.json``.
    Files are opened lazily and memory-mapped by safetensors, so reading one tensor does
    not load the others.
    """

    def __init__(self, path: str | os.PathLike):
        self.directory = Path(path)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        index_path = self.directory / WEIGHTS_INDEX_FILE
        single_path = self.directory / SINGLE_WEIGHTS_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ModelError(f"{index_path}: not a valid safetensors index ({err})") from None
            files = {name: self.directory / fname for name, fname in weight_map.items()}
            for file in set(files.values()):
                if file.parent != self.directory or not file.is_file():
                    raise ModelError(f"{index_path}: names a missing or outside file {file.name!r}")
            self._file_of = files
        elif single_path.is_file():
            for name in self._open(single_path).keys():  # noqa: SIM118 (safe_open has no __iter__)
                self._file_of[name] = single_path
        else:
            raise ModelError(
                f"{self.directory}: no {SINGLE_WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} "
                "(strop reads weights only from safetensors)"
            )

    def _open(self, file: Path) -> Any:
        """The (cached) safetensors handle of ``file``."""
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="numpy")
            except (SafetensorError, OSError) as err:
                raise ModelError(f"{file}: cannot read safetensors file ({err})") from None
        return self._handles[file]

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``, read from the header only."""
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a host numpy array (bfloat16 as ``ml_dtypes.bfloat16``)."""
        try:
            return self._open(self._file_of[name]).get_tensor(name)
        except SafetensorError as err:
            raise ModelError(
                f"{self._file_of[name]}: cannot read tensor {name!r} ({err})"
            ) from None


def check_tensor_names(reader: SafetensorsReader, expected: set[str], *, tied: bool) -> None:
    """Raise a :class:`ModelError` listing missing and unexpected tensor names."""
    present = set(reader.names())
    ignorable = {n for n in present if n.endswith(_DERIVED_SUFFIXES)}
    if tied:
        ignorable.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - ignorable)
    if missing or unexpected:

        def listing(names: list[str]) -> str:
            shown = ", ".join(names[:8])
            return shown + (f", ... ({len(names)} in all)" if len(names) > 8 else "")

        problems = []
        if missing:
            problems.append(f"missing tensors: {listing(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {listing(unexpected)}")
        raise ModelError(
            f"{reader.directory}: weights do not match config.json; {'; '.join(problems)}"
        )


def write_checkpoint(
    path: str | os.PathLike,
    hf_config: dict[str, Any],
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    dtype_name: str,
    source_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Write a HF checkpoint directory that ``transformers`` loads.

    ``tensors`` is consumed once, in order; shards hold at most ``max_shard_bytes`` each
    (a sharded checkpoint gets ``model.safetensors.index.json``). The directory appears
    only when complete: everything is written to a temporary sibling that is then renamed.
    Tokenizer and generation files found in ``source_dir`` are copied along.
    """
    target = Path(path)
    with atomic_directory(target, overwrite=overwrite) as staging:
        _write_shards(staging, tensors, max_shard_bytes)
        config = dict(hf_config)
        config["dtype"] = dtype_name
        config.pop("torch_dtype", None)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if source_dir is not None:
            for name in SIDECAR_FILES:
                if (Path(source_dir) / name).is_file():
                    shutil.copy2(Path(source_dir) / name, staging / name)
    return target


def _write_shards(
    directory: Path, tensors: Iterable[tuple[str, np.ndarray]], max_shard_bytes: int
) -> None:
    """Group tensors into shards of at most ``max_shard_bytes`` and write them."""
    groups: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for name, array in tensors:
        if groups[-1] and sizes[-1] + array.nbytes > max_shard_bytes:
            groups.append({})
            sizes.append(0)
        groups[-1][name] = np.ascontiguousarray(array)
        sizes[-1] += array.nbytes
    if len(groups) == 1:
        save_file(groups[0], str(directory / SINGLE_WEIGHTS_FILE), metadata={"format": "pt"})
        return
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file_name, group in zip(names, groups, strict=True):
        save_file(group, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file_name))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
