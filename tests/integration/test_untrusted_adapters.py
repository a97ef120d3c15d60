"""Hostile adapters given to `strop eval` (eval.adapter) and `strop sft` (lora.restore_path):
one line, ``error: ...`` naming the file, exit 2, on both backends, and no traceback."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strop.config import load_config
from strop.errors import CheckpointError, ConfigError
from strop.io.model_spec import read_model_spec
from strop.io.peft import save_adapter
from strop.io.tiny import make_tiny_checkpoint
from strop.sft.loop import run_sft

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
RANK = 4  # the tiny recipe's lora.rank


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    with (root / "data.jsonl").open("w") as f:
        for a in range(8):
            f.write(json.dumps({"question": f"What is {a} + 1?", "answer": f"#### {a + 1}"}) + "\n")
    with (root / "sft.jsonl").open("w") as f:
        for a in range(8):
            f.write(json.dumps({"prompt": f"What is {a} + 1?", "completion": f" {a + 1}"}) + "\n")
    make_tiny_checkpoint(root / "model", ["What is 1 + 2? 0 1 2 3 4 5 6 7 8 9 ####"], seed=0)
    return root


def adapter(inputs: Path, name: str, *, spoil_config=None, spoil_tensors=None) -> Path:
    """A PEFT adapter on every default target of the tiny model, then spoiled."""
    spec = read_model_spec(inputs / "model")
    weights = {}
    for layer in range(spec.num_layers):
        for projection in PROJECTIONS:
            module = f"model.layers.{layer}.{projection}"
            out_features, in_features = spec.linear_shape(module)
            weights[module] = (
                np.zeros((RANK, in_features), np.float32),
                np.zeros((out_features, RANK), np.float32),
            )
    if spoil_tensors is not None:
        spoil_tensors(weights)
    directory = save_adapter(
        inputs / "adapters" / name, weights, rank=RANK, alpha=8.0, dropout=0.0,
        target_modules=[r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"],
        base_model=str(inputs / "model"), overwrite=True,
    )  # fmt: skip
    if spoil_config is not None:
        path = directory / "adapter_config.json"
        config = json.loads(path.read_text())
        spoil_config(config)
        path.write_text(json.dumps(config))
    return directory


def header_past_end(directory: Path) -> Path:
    path = directory / "adapter_model.safetensors"
    path.write_bytes(struct.pack("<Q", 10**9) + path.read_bytes()[8:])
    return directory


def wide_a(weights) -> None:
    a, b = weights["model.layers.0.self_attn.q_proj"]
    weights["model.layers.0.self_attn.q_proj"] = (np.zeros((RANK, a.shape[1] + 1), a.dtype), b)


def layer_9_of_2(weights) -> None:
    weights["model.layers.9.self_attn.q_proj"] = weights["model.layers.0.self_attn.q_proj"]


def make(inputs: Path, case: str) -> Path:
    if case == "header-past-end":
        return header_past_end(adapter(inputs, case))
    if case == "path-like-target":
        return adapter(inputs, case, spoil_config=lambda c: c.update(target_modules=["../x"]))
    if case == "r-huge":
        return adapter(inputs, case, spoil_config=lambda c: c.update(r=50_000))
    if case == "wide-A":
        return adapter(inputs, case, spoil_tensors=wide_a)
    if case == "layer-9-of-2":
        return adapter(inputs, case, spoil_tensors=layer_9_of_2)
    raise AssertionError(case)


# case -> what the one-line error says (after the adapter's path)
EXPECTED = {
    "header-past-end": "safetensors header claims 1000000000 bytes, more than the file holds",
    "path-like-target": "target_modules entry '../x' is not a module name or regex",
    "r-huge": "r=50000 is larger than the base model's hidden_size=64",
    "wide-A": "model.layers.0.self_attn.q_proj has A [4, 65], B [64, 4]; the base model "
    "needs A [4, 64], B [64, 4]",
    "layer-9-of-2": "model.layers.9.self_attn.q_proj is not a linear layer of the base model",
}


def strop_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strop", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("case", list(EXPECTED))
def test_cli_eval_with_a_hostile_adapter_is_one_line_exit_2(inputs, tmp_path, case):
    bad = make(inputs, case)
    done = strop_cli("eval", "tiny", f"model.path={inputs / 'model'}",
                     f"eval.path={inputs / 'data.jsonl'}", f"run_dir={tmp_path}",
                     f"eval.adapter={bad}", "mesh.fsdp=1", "mesh.data=-1")  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}"), done.stderr[-2000:]
    assert EXPECTED[case] in lines[0]
    assert not (tmp_path / "eval").exists()


def sft_config(inputs: Path, run_dir: Path, backend: str, restore: Path):
    overrides = {
        "backend": backend,
        "model.path": inputs / "model",
        "data.train_path": inputs / "sft.jsonl",
        "run_dir": run_dir,
        "sft.steps": 1,
        "sft.batch_size": 4,
        "sft.micro_batch_size": 4,
        "logging.tensorboard": False,
        "mesh.fsdp": 1,
        "mesh.tensor": -1,  # jax: 8 test devices; rows stay whole (micro-batches < 8)
        "lora.restore_path": restore,
    }
    return load_config("tiny", [f"{k}={v}" for k, v in overrides.items()])


# restore_path goes through the same load_adapter and its check against the base model's
# shapes, before any tensor is read; only the rank is held to the run's lora.rank first.
SFT_CASES = {
    "header-past-end": (CheckpointError, EXPECTED["header-past-end"]),
    "path-like-target": (CheckpointError, EXPECTED["path-like-target"]),
    "r-huge": (ConfigError, "adapter rank r=50000 differs from lora.rank=4"),
    "wide-A": (CheckpointError, re.escape(EXPECTED["wide-A"])),
    "layer-9-of-2": (CheckpointError, EXPECTED["layer-9-of-2"]),
}


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_sft_restore_path_with_hostile_adapters(inputs, tmp_path, backend):
    for case, (error, message) in SFT_CASES.items():
        bad = make(inputs, case)
        with pytest.raises(error, match=message) as caught:
            run_sft(sft_config(inputs, tmp_path / case, backend, bad))
        assert str(bad) in str(caught.value) and "\n" not in str(caught.value)
        assert not (tmp_path / case / "adapter").exists()


def test_cli_sft_with_a_hostile_restore_path_is_one_line_exit_2(inputs, tmp_path):
    bad = make(inputs, "path-like-target")
    done = strop_cli("sft", "tiny", f"model.path={inputs / 'model'}",
                     f"data.train_path={inputs / 'sft.jsonl'}", f"run_dir={tmp_path}",
                     "sft.steps=1", "sft.batch_size=4", "sft.micro_batch_size=4",
                     "mesh.fsdp=1", "mesh.tensor=-1", f"lora.restore_path={bad}")  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr  # log lines come first; the error is one line
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {bad}") and EXPECTED["path-like-target"] in last


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_eval_with_a_sound_adapter_still_runs(inputs, tmp_path, backend):
    from strop.commands.evaluation import run_eval

    good = adapter(inputs, "sound")
    config = load_config("tiny", [
        f"backend={backend}", f"model.path={inputs / 'model'}",
        f"eval.path={inputs / 'data.jsonl'}", f"run_dir={tmp_path}", f"eval.adapter={good}",
        "eval.max_examples=2", "generation.max_new_tokens=4", "mesh.fsdp=1", "mesh.data=-1",
    ])  # fmt: skip
    assert run_eval(config).examples == 2
