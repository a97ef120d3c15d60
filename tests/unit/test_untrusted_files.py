"""Hostile model directories and adapters, crafted byte by byte, are refused cleanly.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON
(name -> dtype, shape, data_offsets), then the data. Every case here must end in a
one-line :class:`ModelError` / :class:`CheckpointError` naming the file and the fault,
before anything big is allocated; the model cases run through ``strop.load_model`` on
both backends, so both reach the same checks in ``strop.io``.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import strop
from strop.errors import CheckpointError, ModelError
from strop.io.hf import MAX_HEADER_BYTES, SafetensorsReader, open_checkpoint
from strop.io.model_spec import read_model_spec
from strop.io.peft import load_adapter, read_adapter_config, save_adapter

RawTensors = dict[str, tuple[str, list[int], bytes]]


def write_safetensors(
    path: Path,
    tensors: RawTensors,
    *,
    header: dict | bytes | None = None,
    header_len: int | None = None,
) -> Path:
    """Write a safetensors file by hand; ``header`` / ``header_len`` override the real ones."""
    data, real = b"", {}
    for name, (dtype, shape, raw) in tensors.items():
        real[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    if header is None:
        header = real
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(
        struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data
    )
    return path


def f32(shape: list[int]) -> tuple[str, list[int], bytes]:
    return ("F32", shape, np.zeros(shape, np.float32).tobytes())


# ---------------------------------------------------------------------------- model dirs


@pytest.fixture(scope="module")
def real_tensors(tiny_model_dir) -> tuple[Path, RawTensors]:
    source = SafetensorsReader(tiny_model_dir("qwen2"))
    raw = {}
    for name in source.names():
        value = source.get(name).astype(np.float32)
        raw[name] = ("F32", list(value.shape), value.tobytes())
    return source.directory, raw


def model_dir(tmp_path: Path, real_tensors, mutate=None, **write) -> Path:
    """A copy of the tiny qwen2 directory whose model.safetensors is written by hand."""
    source, raw = real_tensors
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(source / "config.json", directory / "config.json")
    tensors = dict(raw)
    if mutate is not None:
        mutate(tensors)
    write_safetensors(directory / "model.safetensors", tensors, **write)
    return directory


def _sparse_huge_header(directory: Path) -> None:
    """A file big enough to hold the header it claims, which is over strop's cap."""
    path = directory / "model.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{")
        f.truncate(MAX_HEADER_BYTES + 64)


def _put(name, value):
    return lambda t: t.update({name: value})


EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"

# id -> (how to make model.safetensors hostile, message)
MODEL_CASES = {
    "header-longer-than-file": ({"header_len": 10**6}, "claims 1000000 bytes, more than the file"),
    "header-len-2^64-1": ({"header_len": 2**64 - 1}, "more than the file holds"),
    "header-over-cap": (_sparse_huge_header, "exceeds strop's limit"),
    "header-not-json": ({"header": b"{not json at all"}, "not a valid safetensors file"),
    "header-a-list": ({"header": b"[1, 2, 3]"}, "not a valid safetensors file"),
    "offsets-past-end": (
        {"header": {EMBED: {"dtype": "F32", "shape": [2], "data_offsets": [0, 10**9]}}},
        "not a valid safetensors file",
    ),
    "shape-bigger-than-data": (
        {"header": {EMBED: {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 8]}}},
        "not a valid safetensors file",
    ),
    "unknown-dtype": (
        {"header": {EMBED: {"dtype": "PICKLE", "shape": [2], "data_offsets": [0, 8]}}},
        "not a valid safetensors file",
    ),
    "path-like-name": ({"mutate": _put("../../etc/passwd", f32([2]))}, r"'../../etc/passwd' is not a dotted"),
    "slash-in-name": ({"mutate": _put("model/norm.weight", f32([2]))}, "is not a dotted module path"),
    "nul-in-name": ({"mutate": _put("model.norm\x00.weight", f32([2]))}, r"'model.norm\\x00.weight'"),
    "newline-in-name": ({"mutate": _put("a\nerror: fake", f32([2]))}, r"'a\\nerror: fake'"),
    "int-dtype": ({"mutate": _put(NORM, ("I32", [64], bytes(256)))}, "has dtype I32; weights must be"),
    "bool-dtype": ({"mutate": _put(NORM, ("BOOL", [64], bytes(64)))}, "has dtype BOOL"),
    "fp8-dtype": ({"mutate": _put(NORM, ("F8_E4M3", [64], bytes(64)))}, "has dtype F8_E4M3"),
    "wrong-vocab": ({"mutate": _put(EMBED, f32([257, 64]))}, r"'model.embed_tokens.weight' has shape \[257, 64\], config.json implies \[256, 64\]"),
    "wrong-width": ({"mutate": _put("model.layers.0.self_attn.q_proj.weight", f32([64, 65]))}, r"q_proj.weight' has shape \[64, 65\], config.json implies \[64, 64\]"),
    "no-embedding": ({"mutate": lambda t: t.pop(EMBED)}, "no model.embed_tokens.weight"),
    "extra-tensor": ({"mutate": _put("model.layers.7.mlp.up_proj.weight", f32([2]))}, "unexpected tensors: model.layers.7"),
}  # fmt: skip


def make_model_case(tmp_path, real_tensors, case) -> Path:
    how, _ = MODEL_CASES[case]
    if callable(how):
        directory = model_dir(tmp_path, real_tensors)
        how(directory)
        return directory
    return model_dir(tmp_path, real_tensors, **how)


# Judged against the model a backend builds, not by open_checkpoint alone.
NEEDS_MODEL = ("wrong-width", "extra-tensor")


@pytest.mark.parametrize("case", [c for c in MODEL_CASES if c not in NEEDS_MODEL])
def test_hostile_model_safetensors_rejected_by_reader(tmp_path, real_tensors, case):
    directory = make_model_case(tmp_path, real_tensors, case)
    with pytest.raises(ModelError, match=MODEL_CASES[case][1]) as caught:
        open_checkpoint(directory)
    assert str(directory) in str(caught.value) and "\n" not in str(caught.value)


# The cases the reader alone cannot judge (shapes) and a sample of the others, on both
# backends: the same ModelError from the same shared checks.
BACKEND_CASES = [
    "header-longer-than-file", "header-not-json", "path-like-name", "nul-in-name",
    "int-dtype", "wrong-vocab", "wrong-width", "extra-tensor",
]  # fmt: skip


@pytest.mark.parametrize("backend", ["jax", "torch"])
@pytest.mark.parametrize("case", BACKEND_CASES)
def test_hostile_model_dirs_rejected_by_load_model(tmp_path, real_tensors, case, backend):
    directory = make_model_case(tmp_path, real_tensors, case)
    with pytest.raises(ModelError, match=MODEL_CASES[case][1]) as caught:
        strop.load_model(directory, backend=backend)
    assert str(directory) in str(caught.value) and "\n" not in str(caught.value)


def test_pickle_only_checkpoint_is_refused_by_name(tmp_path, real_tensors):
    directory = model_dir(tmp_path, real_tensors)
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    for backend in ("jax", "torch"):
        with pytest.raises(
            ModelError,
            match=r"found pytorch_model\.bin, but strop reads weights only from safetensors",
        ):
            strop.load_model(directory, backend=backend)


def test_truncated_file_is_refused(tmp_path, real_tensors):
    directory = model_dir(tmp_path, real_tensors)
    (directory / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ModelError, match="too short for a header"):
        SafetensorsReader(directory)


def _index(directory: Path, weight_map) -> Path:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.mark.parametrize(
    ("weight_map", "message"),
    [
        ({EMBED: "../model/model.safetensors"}, "shards must be .safetensors files in the same directory"),
        ({EMBED: "/etc/passwd"}, "shards must be .safetensors files in the same directory"),
        ({EMBED: "model.bin"}, "shards must be .safetensors files"),
        ({EMBED: 3}, "shards must be"),
        ({"../x": "model.safetensors"}, "'../x' is not a dotted module path"),
        (["model.safetensors"], 'needs a non-empty "weight_map" object'),
        ({EMBED: "absent.safetensors"}, "names a missing file 'absent.safetensors'"),
        ({"model.layers.9.mlp.up_proj.weight": "model.safetensors"}, "maps 'model.layers.9.mlp.up_proj.weight' to model.safetensors, which does not hold it"),
    ],
    ids=["dotdot", "absolute", "bin", "not-str", "path-name", "not-object", "missing", "not-in-file"],
)  # fmt: skip
def test_hostile_shard_index(tmp_path, real_tensors, weight_map, message):
    directory = _index(model_dir(tmp_path, real_tensors), weight_map)
    with pytest.raises(ModelError, match=message):
        SafetensorsReader(directory)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 is more than any decoder"),
        ({"num_hidden_layers": 400}, "num_hidden_layers=400, but the weights hold only"),
        ({"intermediate_size": None}, "intermediate_size must be a positive integer, got None"),
        ({"num_key_value_heads": -2}, "num_key_value_heads must be a positive integer"),
        ({"hidden_size": True}, "hidden_size must be a positive integer, got True"),
        ({"rms_norm_eps": "tiny"}, "malformed size field"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope type 'linear' needs factor"),
        ({"rope_parameters": {"rope_theta": "big"}}, "rope_theta must be a number"),
    ],
    ids=[
        "huge-layers",
        "more-layers-than-weights",
        "no-intermediate",
        "negative-kv",
        "bool-size",
        "bad-eps",
        "rope-no-factor",
        "rope-theta-text",
    ],
)
def test_hostile_config_json(tmp_path, real_tensors, change, message):
    directory = model_dir(tmp_path, real_tensors)
    config = json.loads((directory / "config.json").read_text())
    config.update(change)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=message):
        open_checkpoint(directory)


def test_deeply_nested_config_json(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelError, match="not valid JSON"):
        read_model_spec(tmp_path)


# ------------------------------------------------------------------------------ adapters

PREFIX = "base_model.model."
Q0 = "model.layers.0.self_attn.q_proj"
RANK = 4


def adapter_dir(tmp_path: Path, name: str = "adapter") -> Path:
    """A valid PEFT adapter (r=4 on both q_proj of the tiny qwen2) to spoil."""
    weights = {
        f"model.layers.{i}.self_attn.q_proj": (
            np.zeros((RANK, 64), np.float32),
            np.zeros((64, RANK), np.float32),
        )
        for i in range(2)
    }
    return save_adapter(
        tmp_path / name, weights, rank=RANK, alpha=8.0, dropout=0.0,
        target_modules=[r".*q_proj"], base_model="/models/tiny-qwen2",
    )  # fmt: skip


def with_config(directory: Path, **change) -> Path:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in change.items():
        if value is ...:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return directory


def with_tensors(directory: Path, mutate=None, **write) -> Path:
    tensors = {
        f"{PREFIX}model.layers.{i}.self_attn.q_proj.lora_{k}.weight": f32(shape)
        for i in range(2)
        for k, shape in (("A", [RANK, 64]), ("B", [64, RANK]))
    }
    if mutate is not None:
        mutate(tensors)
    write_safetensors(directory / "adapter_model.safetensors", tensors, **write)
    return directory


def _raw_config(text: str):
    def spoil(directory: Path) -> Path:
        (directory / "adapter_config.json").write_text(text)
        return directory

    return spoil


def _pair(module: str):
    """Add a well-shaped A and B for ``module``."""

    def mutate(tensors: RawTensors) -> None:
        for kind, shape in (("A", [RANK, 64]), ("B", [64, RANK])):
            tensors[f"{PREFIX}{module}.lora_{kind}.weight"] = f32(shape)

    return mutate


A0, B0 = f"{PREFIX}{Q0}.lora_A.weight", f"{PREFIX}{Q0}.lora_B.weight"

# id -> (spoil(adapter dir) -> dir, message); checked with the base model's spec
ADAPTER_CASES = {
    "config-not-json": (_raw_config("{'r': 4"), "adapter_config.json: not valid JSON"),
    "config-a-list": (_raw_config("[4]"), "adapter_config.json: expected a JSON object"),
    "config-nested": (_raw_config("[" * 100_000), "adapter_config.json: not valid JSON"),
    "peft-type-unknown": (lambda d: with_config(d, peft_type="PREFIX_TUNING"), "peft_type must be \"LORA\""),
    "r-missing": (lambda d: with_config(d, r=...), "r must be a positive integer, got None"),
    "r-zero": (lambda d: with_config(d, r=0), "r must be a positive integer, got 0"),
    "r-string": (lambda d: with_config(d, r="4"), "r must be a positive integer, got '4'"),
    "r-bool": (lambda d: with_config(d, r=True), "r must be a positive integer, got True"),
    "r-float": (lambda d: with_config(d, r=4.0), "r must be a positive integer, got 4.0"),
    "r-huge": (lambda d: with_config(d, r=10**12), "r must be at most 65536"),
    "r-over-width": (lambda d: with_config(d, r=128), "r=128 is larger than the base model's hidden_size=64"),
    "alpha-negative": (lambda d: with_config(d, lora_alpha=-8), "lora_alpha must be a positive number"),
    "alpha-string": (lambda d: with_config(d, lora_alpha="8"), "lora_alpha must be a positive number"),
    "alpha-nan": (_raw_config('{"peft_type": "LORA", "r": 4, "lora_alpha": NaN, "target_modules": "q_proj"}'), "lora_alpha must be a positive number"),
    "alpha-huge-int": (lambda d: with_config(d, lora_alpha=10**400), "lora_alpha must be a positive number"),
    "targets-dotdot": (lambda d: with_config(d, target_modules=["../x"]), r"target_modules entry '../x' is not a module name"),
    "targets-slash": (lambda d: with_config(d, target_modules="model/layers"), "is not a module name or regex"),
    "targets-nul": (lambda d: with_config(d, target_modules=["q_proj\x00"]), r"'q_proj\\x00' is not a module name"),
    "targets-empty": (lambda d: with_config(d, target_modules=[]), "target_modules must be a module-name regex"),
    "targets-not-str": (lambda d: with_config(d, target_modules=[1]), "target_modules entry '1' is not"),
    "targets-missing": (lambda d: with_config(d, target_modules=...), "target_modules must be"),
    "targets-bad-regex": (lambda d: with_config(d, target_modules=["(q_proj"]), "is not a valid regex"),
    "targets-huge": (lambda d: with_config(d, target_modules=["q" * 5000]), "at most 1000 characters"),
    "dora": (lambda d: with_config(d, use_dora=True), "DoRA adapters are not supported"),
    "rank-pattern": (lambda d: with_config(d, rank_pattern={"q_proj": 8}), "rank_pattern is not supported"),
    "fan-in-fan-out": (lambda d: with_config(d, fan_in_fan_out=True), "fan_in_fan_out=true is not supported"),
    "bias": (lambda d: with_config(d, bias="all"), "bias must be \"none\""),
    "header-longer-than-file": (lambda d: with_tensors(d, header_len=10**7), "adapter_model.safetensors: safetensors header claims"),
    "header-not-json": (lambda d: with_tensors(d, header=b"{{{{"), "adapter_model.safetensors: not a valid safetensors file"),
    "offsets-past-end": (lambda d: with_tensors(d, header={A0: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 10**9]}}), "not a valid safetensors file"),
    "path-like-name": (lambda d: with_tensors(d, _put(f"{PREFIX}../../x.lora_A.weight", f32([RANK, 64]))), "is not a dotted module path"),
    "int-dtype": (lambda d: with_tensors(d, _put(A0, ("I64", [RANK, 64], bytes(RANK * 64 * 8)))), "has dtype I64"),
    "foreign-tensor": (lambda d: with_tensors(d, _put("model.embed_tokens.weight", f32([256, 64]))), "unexpected tensor 'model.embed_tokens.weight'"),
    "A-wrong-rank": (lambda d: with_tensors(d, _put(A0, f32([RANK + 1, 64]))), r"has A \[5, 64\], B \[64, 4\]; expected rank r=4"),
    "A-wrong-width": (lambda d: with_tensors(d, _put(A0, f32([RANK, 65]))), r"has A \[4, 65\], B \[64, 4\]; the base model needs A \[4, 64\], B \[64, 4\] \(was it made for another base model\? it names '/models/tiny-qwen2'\)"),
    "B-wrong-out": (lambda d: with_tensors(d, _put(B0, f32([96, RANK]))), r"the base model needs A \[4, 64\], B \[64, 4\]"),
    "A-3d": (lambda d: with_tensors(d, _put(A0, f32([RANK, 8, 8]))), "needs 2-D lora_A and lora_B"),
    "B-missing": (lambda d: with_tensors(d, lambda t: t.pop(B0)), "needs both lora_A and lora_B"),
    "no-tensors": (lambda d: with_tensors(d, lambda t: t.clear()), "holds no LoRA tensors"),
    "layer-beyond-model": (lambda d: with_tensors(d, _pair("model.layers.9.self_attn.q_proj")), "model.layers.9.self_attn.q_proj is not a linear layer of the base model"),
    "not-a-linear": (lambda d: with_tensors(d, _pair("model.norm")), "model.norm is not a linear layer"),
}  # fmt: skip


def make_adapter_case(tmp_path: Path, case: str) -> Path:
    spoil, _ = ADAPTER_CASES[case]
    return spoil(adapter_dir(tmp_path, case))


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_hostile_adapters_rejected(tmp_path, tiny_model_dir, case):
    directory = make_adapter_case(tmp_path, case)
    spec = read_model_spec(tiny_model_dir("qwen2"))
    with pytest.raises(CheckpointError, match=ADAPTER_CASES[case][1]) as caught:
        load_adapter(directory, spec)
    assert str(directory) in str(caught.value) and "\n" not in str(caught.value)


def test_valid_adapter_loads_with_and_without_spec(tmp_path, tiny_model_dir):
    directory = adapter_dir(tmp_path)
    spec = read_model_spec(tiny_model_dir("qwen2"))
    for with_spec in (None, spec):
        config, weights = load_adapter(directory, with_spec)
        assert config["r"] == RANK and sorted(weights) == [Q0, "model.layers.1.self_attn.q_proj"]
        assert weights[Q0][0].shape == (RANK, 64) and weights[Q0][1].shape == (64, RANK)
    assert read_adapter_config(directory / "adapter_config.json")["lora_alpha"] == 8.0


def test_pickle_only_adapter_is_refused_by_name(tmp_path):
    directory = adapter_dir(tmp_path)
    (directory / "adapter_model.safetensors").rename(directory / "adapter_model.bin")
    with pytest.raises(
        CheckpointError, match=r"has adapter_model\.bin but no adapter_model\.safetensors"
    ):
        load_adapter(directory)
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_adapter(tmp_path / "nowhere")
