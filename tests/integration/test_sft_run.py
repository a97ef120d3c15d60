"""`strop sft` end to end: data -> LoRA training -> checkpoints -> resume -> export."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import strop
from strop.config import load_config
from strop.errors import CheckpointError
from strop.metrics.sinks import read_metrics
from strop.sft.loop import run_sft
from tests.run_facts import ONCE_EACH, counting_run_facts
from tests.tiny_models import save_tiny_model
from tests.tiny_tokenizer import save_tiny_tokenizer


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory):
    """A tiny one-layer Qwen2 (a layer fewer: quicker compiles) with a real tokenizer, and a
    small prompt/completion file."""
    root = tmp_path_factory.mktemp("sft")
    model_dir = save_tiny_model("qwen2_tied", root / "model", vocab_size=512, num_hidden_layers=1)
    save_tiny_tokenizer(model_dir)
    rng = np.random.default_rng(0)
    with (root / "train.jsonl").open("w") as f:
        for _ in range(24):
            a, b = rng.integers(1, 50, 2)
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "completion": f" {a + b}"}) + "\n")
    return model_dir, root / "train.jsonl"


def config_for(sft_inputs, run_dir, **overrides):
    model_dir, train = sft_inputs
    base = {
        "model.path": model_dir,
        "data.train_path": train,
        "data.pad_to_multiple": 16,
        "run_dir": run_dir,
        "sft.steps": 6,
        "sft.batch_size": 8,
        "sft.micro_batch_size": 4,
        "checkpoint.every_steps": 3,
        "logging.every_steps": 1,
        "logging.tensorboard": False,
        "optim.lr": 1e-2,
        "mesh.fsdp": 1,
        "mesh.tensor": -1,  # jax: 8 test devices; rows stay whole (micro-batches < 8)
    }
    base.update(overrides)
    return load_config("tiny", [f"{k}={v}" for k, v in base.items()])


BACKENDS = pytest.mark.parametrize("backend", ["jax", "torch"])


def test_an_sft_run_reads_its_facts_once_before_step_1(sft_inputs, tmp_path, monkeypatch):
    """The model's config.json, the job identity and the checkpoint listing: read once,
    at preflight, and handed on (issue 46)."""
    with counting_run_facts(monkeypatch) as counts:
        run_sft(config_for(sft_inputs, tmp_path / "run", backend="torch"), stop_after=0)
    assert counts == ONCE_EACH


@BACKENDS
def test_resume_continues_exactly_and_restore_path_rules(sft_inputs, tmp_path, backend, caplog):
    config = config_for(sft_inputs, tmp_path / "straight", backend=backend)
    straight = run_sft(config)
    assert straight.final_step == 6 and len(straight.losses) == 6
    # the run directory says what ran: the resolved config (a recipe) and the versions
    assert load_config(tmp_path / "straight" / "config.yaml") == config
    versions = json.loads((tmp_path / "straight" / "versions.json").read_text())
    assert versions["strop"] == strop.__version__ and versions["job"] == "sft"
    assert versions["packages"][backend] == importlib.metadata.version(backend)
    assert (straight.export_path / "adapter_model.safetensors").exists()
    records = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all("train/loss" in r and "throughput/tokens_per_s" in r for r in records)

    # Stop after the step-3 checkpoint (as a killed run would), then start again with an
    # adapter to restore: the resumed run must ignore it and continue exactly.
    interrupted = run_sft(
        config_for(sft_inputs, tmp_path / "resumed", backend=backend), stop_after=3
    )
    assert interrupted.export_path is None
    resumed = run_sft(
        config_for(
            sft_inputs,
            tmp_path / "resumed",
            backend=backend,
            **{"lora.restore_path": straight.export_path},
        )
    )
    assert resumed.resumed_from == 3
    assert interrupted.losses + resumed.losses == straight.losses
    changed = [r.message for r in caplog.records if "ran before with another config" in r.message]
    assert (
        len(changed) == 1 and f"lora.restore_path: None -> '{straight.export_path}'" in (changed[0])
    )

    # A fresh run honours lora.restore_path: it starts from the trained adapter.
    seeded = run_sft(
        config_for(
            sft_inputs,
            tmp_path / "seeded",
            backend=backend,
            **{"lora.restore_path": straight.export_path, "sft.steps": 1},
        )
    )
    assert seeded.resumed_from is None
    assert seeded.losses[0] < straight.losses[0] - 0.1


@BACKENDS
def test_cli_sft_then_export_merged_matches_peft(sft_inputs, tmp_path, backend):
    model_dir, train = sft_inputs
    overrides = [
        f"backend={backend}",
        f"model.path={model_dir}",
        f"data.train_path={train}",
        "data.pad_to_multiple=16",
        f"run_dir={tmp_path / 'run'}",
        "sft.steps=3",
        "sft.batch_size=4",
        "sft.micro_batch_size=2",
        "optim.lr=1e-2",
        "mesh.fsdp=1",
        "mesh.tensor=-1",  # jax: 8 test devices; rows stay whole (micro-batches < 8)
    ]
    cmd = [sys.executable, "-m", "strop"]
    done = subprocess.run([*cmd, "sft", "tiny", *overrides], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    adapter = tmp_path / "run" / "adapter"
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert any((tmp_path / "run" / "tensorboard").iterdir())

    merged = tmp_path / "merged"
    done = subprocess.run(  # the run directory alone: the rest comes from its config.yaml
        [*cmd, "export", str(tmp_path / "run"), "--merged", "--out", str(merged)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]

    ids = torch.tensor([[5, 17, 42, 99, 7, 300]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        via_peft = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        via_merged = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids).logits
    assert (via_peft - via_merged).abs().max() < 1e-4
    assert (via_peft - plain).abs().max() > 1e-3


def test_cli_sft_bad_data_is_one_line_error(sft_inputs, tmp_path):
    model_dir, _ = sft_inputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": " b"}\n{"prompt": 3}\n')
    done = subprocess.run(
        [sys.executable, "-m", "strop", "sft", "tiny", f"model.path={model_dir}",
         f"data.train_path={bad}", f"run_dir={tmp_path / 'run'}", "mesh.fsdp=1",
         "mesh.tensor=-1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "bad.jsonl:2" in lines[0]


def _tree_digest(directory) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_a_run_directory_of_the_other_backend_is_refused(sft_inputs, tmp_path):
    """Each backend refuses a run directory the other one checkpointed, before anything
    loads, and leaves the other run's checkpoints as they were. The torch run is trained;
    the JAX one is its checkpoint's identity where Orbax writes it (what preflight reads:
    a JAX run's compiles cost 30 s here, and its real layout is held by
    test_jax_checkpoint.py)."""
    from strop.io.checkpoint_dir import IDENTITY_FILES

    run_sft(config_for(sft_inputs, tmp_path / "torch", backend="torch", **{"sft.steps": 3}))
    identity = tmp_path / "jax" / "checkpoints" / "3" / IDENTITY_FILES["jax"]
    identity.parent.mkdir(parents=True)
    identity.write_text((tmp_path / "torch" / "checkpoints" / "3" / "identity.json").read_text())
    runs = {b: (tmp_path / b, _tree_digest(tmp_path / b / "checkpoints")) for b in ("jax", "torch")}
    for wrote, resumes in (("jax", "torch"), ("torch", "jax")):
        run_dir, before = runs[wrote]
        config = config_for(sft_inputs, run_dir, backend=resumes, **{"sft.steps": 6})
        with pytest.raises(CheckpointError) as err:
            run_sft(config)
        message = str(err.value)
        assert f"holds checkpoints the {wrote} backend wrote (steps 3)" in message, message
        assert f"Resume with backend={wrote}, or start this run in a new run" in message
        assert _tree_digest(run_dir / "checkpoints") == before  # not a byte changed
    model_dir, train = sft_inputs
    done = subprocess.run(
        [sys.executable, "-m", "strop", "sft", "tiny", f"model.path={model_dir}",
         f"data.train_path={train}", f"run_dir={runs['torch'][0]}", "backend=jax"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert "the torch backend wrote" in lines[0]


def test_torch_resume_with_another_identity_is_refused(sft_inputs, tmp_path):
    """The torch twin of test_jax_checkpoint's identity test, through `run_sft`: another
    LoRA rank, other targets, LoRA off, another base model; each refused by name."""
    run_dir = tmp_path / "run"
    run_sft(config_for(sft_inputs, run_dir, backend="torch", **{"sft.steps": 3}))
    before = _tree_digest(run_dir / "checkpoints")
    other_base = tmp_path / "other-base"
    shutil.copytree(sft_inputs[0], other_base)
    weights = next(other_base.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the same config, other weights
    weights.write_bytes(bytes(data))
    cases = {
        "lora.rank is 4 in the checkpoint but 8 now": {"lora.rank": 8},
        "lora.targets": {"lora.target_modules": "[.*q_proj]"},
        "lora.enabled is True in the checkpoint but False now": {"lora.enabled": False},
        "base model weights differ": {"model.path": other_base},
    }
    for expected, overrides in cases.items():
        config = config_for(sft_inputs, run_dir, backend="torch", **{"sft.steps": 6, **overrides})
        with pytest.raises(CheckpointError, match="new run directory") as err:
            run_sft(config)
        assert expected in str(err.value), str(err.value)
    assert _tree_digest(run_dir / "checkpoints") == before


def test_a_full_disk_is_the_checkpoint_s_one_line(sft_inputs, tmp_path):
    """JAX SFT with its run directory on a small disk: the first save fills it and fails
    in one line, then the TensorBoard flush at close failed on the same disk and buried
    that line under an OSError traceback (exit 1). A save that fails leaves Orbax's
    partial step, so the disk stays full while the run stops."""
    from tests.mounts import tmpfs

    with tmpfs(tmp_path / "disk", "64k") as disk:
        config = config_for(
            sft_inputs, disk / "run", backend="jax",
            **{"sft.steps": 12, "checkpoint.every_steps": 12, "logging.tensorboard": True},
        )  # fmt: skip
        with pytest.raises(CheckpointError) as failure:
            run_sft(config)
    message = str(failure.value)
    assert message.startswith(f"saving checkpoint step 12 to {disk / 'run' / 'checkpoints'}")
    assert "No space left on device" in message and "tensorstore_spec" not in message
    assert "no checkpoint was written yet" in message and "KiB free there" in message
