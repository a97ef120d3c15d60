"""Orbax training checkpoints of the JAX backend: exact resume, content, crash safety."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import strop
from strop.backends.jax.checkpoint import TrainCheckpoints, to_pure
from strop.backends.jax.lora import BASE_WEIGHTS, apply_lora, trainable_filter
from strop.backends.jax.sharding import make_mesh
from strop.backends.jax.train import Trainer
from strop.config import LoraConfig, OptimConfig
from strop.errors import CheckpointError, NonFiniteStateError
from strop.io.run_identity import identity_differences, run_identity
from tests.tiny_models import TINY

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)
NO_LORA = LoraConfig(enabled=False)
# Warmup + cosine + clipping: resuming must also restore the schedule's step counters.
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine")


def one_device():
    return make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


def setup(model_dir, mesh=None, lora=LORA, seed=0):
    """A fresh model (+ adapters) and trainer, as a new process would build them."""
    handle = strop.load_model(model_dir, mesh=mesh or one_device())
    model = apply_lora(handle.model, lora, seed=seed) if lora.enabled else handle.model
    trainable = trainable_filter(lora.enabled)
    return model, Trainer(model, handle.mesh, OPTIM, total_steps=6, trainable=trainable)


def next_batch(rng: np.random.Generator, rows: int = 4, length: int = 12) -> dict:
    ids = rng.integers(0, TINY["vocab_size"], (rows, length))
    mask = np.ones((rows, length), np.int32)
    mask[::2, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.astype(np.float32)}


def host(tree) -> list[np.ndarray]:
    return [np.array(leaf) for leaf in jax.tree.leaves(tree)]


def perturb(trainer) -> None:
    """Move every trainable and optimizer array away from its current value."""
    trainer.load(*jax.tree.map(lambda x: x + 1, (trainer.params, trainer.opt_state)))


def restore(saver, step, trainer) -> dict:
    """Load checkpoint ``step`` into ``trainer``, as ``JaxPolicy`` does; return ``extra``."""
    params, opt_state, extra = saver.restore(step, trainer.params, trainer.opt_state)
    trainer.load(params, opt_state)
    return extra


def updates_applied(trainer) -> list[int]:
    """The optax state's step counters (the schedule's clock among them)."""
    return [int(count) for _, count in optax.tree.get_all_with_path(trainer.opt_state, "count")]


def checkpoints(directory, model_dir, lora=LORA, keep=3) -> TrainCheckpoints:
    return TrainCheckpoints(directory, run_identity(model_dir, lora, backend="jax"), keep=keep)


def test_resume_is_exact(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    model, trainer = setup(model_dir)
    rng = np.random.default_rng(7)
    straight = [trainer.step(next_batch(rng), 2)["loss"] for _ in range(6)]
    straight_lora = host(nnx.state(model, nnx.LoRAParam))

    model, trainer = setup(model_dir)
    base_before = host(nnx.state(model, BASE_WEIGHTS))
    rng = np.random.default_rng(7)
    resumed = [trainer.step(next_batch(rng), 2)["loss"] for _ in range(3)]
    saver = checkpoints(tmp_path / "ck", model_dir)
    extra = {"data_position": 3, "rng": rng.bit_generator.state}
    saver.save(3, trainer.params, trainer.opt_state, extra)
    del model, trainer, rng, saver

    model, trainer = setup(model_dir)  # a new process: fresh adapters, fresh optimizer
    saver = checkpoints(tmp_path / "ck", model_dir)
    step = saver.latest_step()
    assert step == 3
    extra = restore(saver, step, trainer)
    assert extra["data_position"] == 3 and set(updates_applied(trainer)) == {3}
    rng = np.random.default_rng()
    rng.bit_generator.state = extra["rng"]
    resumed += [trainer.step(next_batch(rng), 2)["loss"] for _ in range(3)]

    assert resumed == straight
    for got, want in zip(host(nnx.state(model, nnx.LoRAParam)), straight_lora, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(host(nnx.state(model, BASE_WEIGHTS)), base_before, strict=True):
        np.testing.assert_array_equal(got, want)  # restore touches trainable state only
    assert trainer.traces.count == 1  # restored arrays kept the step's shardings


def test_lora_checkpoint_stores_no_base_weights(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    sizes = {}
    for name, lora in (("lora", LORA), ("full", NO_LORA)):
        model, trainer = setup(model_dir, lora=lora)
        saver = checkpoints(tmp_path / name, model_dir, lora=lora)
        saver.save(1, trainer.params, trainer.opt_state)
        stored = saver.stored_params(1)
        expected = nnx.to_flat_state(nnx.state(model, trainer.trainable))
        assert stored == sorted(".".join(map(str, path)) for path, _ in expected)
        base = [p for p in stored if not p.endswith(("kernel_lora_a", "kernel_lora_b"))]
        if name == "lora":
            assert stored and not base
        else:
            assert "model.layers.0.self_attn.q_proj.kernel" in base
            assert "model.embed_tokens.embedding" in base
        sizes[name] = sum(f.stat().st_size for f in (tmp_path / name).rglob("*") if f.is_file())
    assert sizes["lora"] < sizes["full"] / 2


def test_keeps_only_the_last_k(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    _, trainer = setup(model_dir)
    saver = checkpoints(tmp_path, model_dir, keep=2)
    assert saver.latest_step() is None
    for step in range(1, 6):
        saver.save(step, trainer.params, trainer.opt_state, {"step": step})
    assert saver.all_steps() == [4, 5] and saver.latest_step() == 5
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["4", "5"]
    with pytest.raises(CheckpointError, match="already exists"):
        saver.save(5, trainer.params, trainer.opt_state)


def test_identity_mismatch_is_refused(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    model, trainer = setup(model_dir)
    checkpoints(tmp_path, model_dir).save(1, trainer.params, trainer.opt_state)
    before = host(nnx.state(model, nnx.LoRAParam))
    cases = {
        "lora.rank is 4 in the checkpoint but 8 now": run_identity(
            model_dir, LORA.model_copy(update={"rank": 8}), backend="jax"
        ),
        "lora.targets": run_identity(
            model_dir, LORA.model_copy(update={"target_modules": [".*q_proj"]}), backend="jax"
        ),
        "lora.enabled": run_identity(model_dir, NO_LORA, backend="jax"),
        "base model config.json differ": run_identity(
            tiny_model_dir("llama3"), LORA, backend="jax"
        ),
        "backend is 'jax' in the checkpoint but 'torch' now": {
            **run_identity(model_dir, LORA, backend="jax"),
            "backend": "torch",
        },
    }
    for expected, identity in cases.items():
        saver = TrainCheckpoints(tmp_path, identity)
        with pytest.raises(CheckpointError, match="new run directory") as err:
            restore(saver, 1, trainer)
        assert expected in str(err.value)
    for got, want in zip(host(nnx.state(model, nnx.LoRAParam)), before, strict=True):
        np.testing.assert_array_equal(got, want)  # nothing was loaded
    with pytest.raises(CheckpointError, match="no complete checkpoint for step 9"):
        restore(checkpoints(tmp_path, model_dir), 9, trainer)


def test_a_checkpoint_of_multi_dimensional_kernels_is_refused_in_one_line(
    tiny_model_dir, tmp_path, capfd
):
    """Before the projections became flat ``[in, out]`` kernels, k_proj's LoRA B was stored
    as ``[r, kv_heads, head_dim]``: such a checkpoint is refused from its metadata, in one
    line that says why, before Orbax reads an array (its own refusal printed pages)."""
    model_dir = tiny_model_dir("qwen2")
    model, trainer = setup(model_dir)
    old = to_pure(trainer.params)
    spec = model.spec
    for layer in old["model"]["layers"].values():
        b = layer["self_attn"]["k_proj"]["kernel_lora_b"]
        layer["self_attn"]["k_proj"]["kernel_lora_b"] = b.reshape(
            LORA.rank, spec.num_kv_heads, spec.head_dim
        )
    checkpoints(tmp_path, model_dir).save(1, old, trainer.opt_state)
    before = host(nnx.state(model, nnx.LoRAParam))
    capfd.readouterr()
    with pytest.raises(CheckpointError) as err:
        restore(checkpoints(tmp_path, model_dir), 1, trainer)
    shape = (LORA.rank, spec.num_kv_heads, spec.head_dim)
    assert str(err.value) == (
        f"cannot restore checkpoint {tmp_path / '1'}: params "
        f"model.layers.0.self_attn.k_proj.kernel_lora_b is stored as {shape}, this model's is "
        f"{(LORA.rank, spec.num_kv_heads * spec.head_dim)} (and 1 more); it holds "
        "multi-dimensional projection kernels, the layout strop's JAX backend used before its "
        "kernels became flat [in, out]: resume it with the strop version that wrote it, or "
        "start the run afresh"
    )
    assert "Traceback" not in "".join(capfd.readouterr())
    for got, want in zip(host(nnx.state(model, nnx.LoRAParam)), before, strict=True):
        np.testing.assert_array_equal(got, want)  # nothing was loaded


def test_same_base_at_another_path_matches(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    moved = shutil.copytree(model_dir, tmp_path / "moved")
    here, there = (
        run_identity(model_dir, LORA, backend="jax"),
        run_identity(moved, LORA, backend="jax"),
    )
    assert here["base_model"] != there["base_model"]
    assert identity_differences(here, there) == []
    weights = next(Path(moved).glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # other weights, same config
    weights.write_bytes(bytes(data))
    assert identity_differences(here, run_identity(moved, LORA, backend="jax")) == [
        f"base model weights differ (checkpoint: {here['base_model']}, now: {moved})"
    ]


def test_restore_keeps_shardings_on_8_devices(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model, trainer = setup(model_dir, mesh=mesh)
    perturb(trainer)  # non-trivial values (a step would compile: slow)
    saver = checkpoints(tmp_path, model_dir)
    saver.save(1, trainer.params, trainer.opt_state)
    saved = host(nnx.state(model, nnx.LoRAParam)) + host(trainer.opt_state)

    model, trainer = setup(model_dir, mesh=mesh, seed=1)
    live = nnx.state(model, nnx.LoRAParam), trainer.opt_state
    want = [leaf.sharding for leaf in jax.tree.leaves(live)]
    assert any(len(s.device_set) == 8 and not s.is_fully_replicated for s in want)
    restore(saver, 1, trainer)
    restored = jax.tree.leaves((nnx.state(model, nnx.LoRAParam), trainer.opt_state))
    assert [leaf.sharding for leaf in restored] == want
    for got, expected in zip(host(restored), saved, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_half_written_checkpoint_is_ignored(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = tiny_model_dir("qwen2")
    model, trainer = setup(model_dir)
    saver = checkpoints(tmp_path, model_dir)
    saver.save(1, trainer.params, trainer.opt_state, {"at": 1})
    saved = host(nnx.state(model, nnx.LoRAParam))
    perturb(trainer)

    # The disk fails at the last moment: step 2 is fully written under its temporary name.
    real_rename = os.rename

    def failing_rename(src, dst, *args, **kwargs):
        if Path(src).name.startswith("2.orbax-checkpoint-tmp"):  # the step, not its items
            raise OSError(28, "No space left on device")
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(CheckpointError, match="previous checkpoint \\(1\\) is intact"):
        saver.save(2, trainer.params, trainer.opt_state, {"at": 2})
    monkeypatch.undo()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("2.orbax-checkpoint-tmp")]
    assert leftovers and (leftovers[0] / "params").is_dir()
    assert saver.latest_step() == 1

    (tmp_path / "7.orbax-checkpoint-tmp-123").mkdir()  # a killed run's partial step
    (tmp_path / "7.orbax-checkpoint-tmp-123" / "params").mkdir()
    reopened = checkpoints(tmp_path, model_dir)
    assert reopened.all_steps() == [1] and reopened.latest_step() == 1
    assert restore(reopened, 1, trainer) == {"at": 1}
    for got, want in zip(host(nnx.state(model, nnx.LoRAParam)), saved, strict=True):
        np.testing.assert_array_equal(got, want)
    # The resumed run saves step 2 again over the leftover; leftovers are cleaned up.
    reopened.save(2, trainer.params, trainer.opt_state, {"at": 2})
    assert reopened.all_steps() == [1, 2]
    assert not any("orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())


def test_damaged_checkpoint_is_one_line_naming_the_intact_step(tiny_model_dir, tmp_path, capfd):
    """Every file's sha256 is stored with the step (before Orbax renames it into place) and
    verified before Orbax reads an array: bytes changed in place and a truncated file are
    refused in one line naming the intact step; a step without checksums (older strop)
    still restores, and Orbax's own read error is one short line."""
    model_dir = tiny_model_dir("qwen2")
    model, trainer = setup(model_dir)
    saver = checkpoints(tmp_path, model_dir)
    saver.save(1, trainer.params, trainer.opt_state, {"at": 1})
    saved = host(nnx.state(model, nnx.LoRAParam))
    perturb(trainer)
    saver.save(2, trainer.params, trainer.opt_state, {"at": 2})
    assert {"params", "optimizer"} <= {p.split("/")[0] for p in manifest(tmp_path / "2")}
    # the largest of the OCDBT data files (d/...), ties broken by name: a file every
    # restore reads (the largest of any kind, in the file system's order, was once a
    # file Orbax restored without)
    data_files = sorted(p for p in (tmp_path / "2" / "params").rglob("*") if p.parent.name == "d")
    largest = max(data_files, key=lambda p: p.stat().st_size)
    data = largest.read_bytes()
    name = largest.relative_to(tmp_path / "2").as_posix()
    largest.write_bytes(data[:100] + bytes(b ^ 1 for b in data[100:110]) + data[110:])
    capfd.readouterr()
    with pytest.raises(CheckpointError) as caught:
        restore(saver, 2, trainer)
    assert str(caught.value) == (
        f"checkpoint step 2 in {tmp_path} is damaged ({name} differs from what was written "
        f"(sha256 mismatch)); step 1 is intact: delete {tmp_path / '2'} to resume from step 1"
    )
    largest.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=rf"\({name} has 100 bytes, {len(data)} were "
                       r"written\); step 1 is intact"):  # fmt: skip
        restore(saver, 2, trainer)

    (tmp_path / "2" / "checksums.json").unlink()  # as strop wrote steps before checksums
    with pytest.raises(CheckpointError) as caught:
        restore(saver, 2, trainer)
    assert str(caught.value).startswith(f"cannot restore checkpoint {tmp_path / '2'}: ")
    assert len(str(caught.value)) < 300 + len(str(tmp_path)), str(caught.value)
    (tmp_path / "1" / "checksums.json").unlink()
    assert restore(saver, 1, trainer) == {"at": 1}
    for got, want in zip(host(nnx.state(model, nnx.LoRAParam)), saved, strict=True):
        np.testing.assert_array_equal(got, want)
    assert "Traceback" not in capfd.readouterr().err


def manifest(step_dir: Path) -> dict:
    return json.loads((step_dir / "checksums.json").read_text())["files"]


def test_unusable_directory_and_bad_extra(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen2")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot use checkpoint directory"):
        checkpoints(blocker / "checkpoints", model_dir)
    _, trainer = setup(model_dir)
    saver = checkpoints(tmp_path / "ck", model_dir)
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        saver.save(1, trainer.params, trainer.opt_state, {"rng": object()})
    assert saver.latest_step() is None
    with pytest.raises(CheckpointError, match="cannot identify base model"):
        run_identity(tmp_path / "nowhere", LORA, backend="jax")


def test_non_finite_state_is_never_saved(tmp_path):
    """A weight or optimizer moment gone NaN/Inf after a finite step: the checkpoint is
    refused (NonFiniteStateError, exit 3) and the last complete one kept."""
    saver = TrainCheckpoints(tmp_path, {"run": 1})
    params = {"layer": {"kernel": jnp.ones((2, 3)), "count": jnp.arange(3)}}
    moments = {"mu": jnp.zeros((2, 3)), "step": jnp.asarray(1)}
    saver.save(1, params, moments, {"step": 1})
    poisoned = {
        "layer": {**params["layer"], "kernel": params["layer"]["kernel"].at[0, 2].set(jnp.inf)}
    }
    with pytest.raises(NonFiniteStateError, match=r"checkpoint step 2: non-finite values in "
                       r"params\.layer\.kernel; this state was not saved \(last complete "
                       r"checkpoint: step 1"):  # fmt: skip
        saver.save(2, poisoned, moments, {"step": 2})
    with pytest.raises(NonFiniteStateError, match=r"optimizer\.mu"):
        saver.save(2, params, {**moments, "mu": moments["mu"].at[1, 1].set(jnp.nan)})
    assert saver.all_steps() == [1]
    assert not [p.name for p in tmp_path.iterdir() if "tmp" in p.name]
