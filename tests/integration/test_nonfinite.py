"""NaN/Inf losses and gradients, injected for real: a tiny model whose embedding row for
the token ``@`` is +inf (or NaN) in memory, and data in which only some lines contain
``@``. (On disk the model is finite, since strop refuses NaN/Inf weights at load; the row
is poisoned as it is read: ``poisoned_strop.py``.)

Every forward over a row with ``@`` is non-finite (RMSNorm of an inf hidden state is
NaN), so exactly the optimizer steps whose batch holds such a row go non-finite. Checked
on both backends, for SFT and for PPO's critic and policy updates:

- a non-finite step is never applied: parameters and optimizer state stay bit-identical;
- without ``train.skip_nonfinite`` the CLI stops with exit code 3 and one line naming the
  step, the values and the kept checkpoint; nothing is saved after the bad step, and the
  kept checkpoint resumes;
- with ``train.skip_nonfinite=true`` the run finishes, ``*/nonfinite_skipped`` in
  metrics.jsonl counts exactly the poisoned steps, and the saved adapters are finite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from strop.config import load_config
from strop.io.run_identity import PolicyRun
from strop.io.tiny import make_tiny_checkpoint
from strop.metrics.sinks import read_metrics
from strop.objectives.roles import RolePlan
from strop.rl.ppo import run_ppo
from strop.rl.prompts import PromptSet
from strop.run.job import build_trained_model
from strop.run.kinds import run_kind
from strop.run.preflight import preflight
from strop.sft.loop import run_sft
from tests.integration.poisoned_strop import install, write_poison

BACKENDS = pytest.mark.parametrize("backend", ["jax", "torch"])
POISON = "@"  # never in the tokenizer's training texts: a token of its own
TEXTS = [f"Question: What is {a} + {b}?\nAnswer: {a + b}" for a in range(10) for b in range(10)]
EXIT_NONFINITE = 3
POISONED_STROP = [sys.executable, str(Path(__file__).with_name("poisoned_strop.py"))]


def poisoned_model(directory: Path, value: float) -> tuple[Path, int]:
    """A tiny Qwen2 whose input embedding of ``@`` reads as ``value``; returns (dir, token
    id). The file stays finite (strop refuses NaN/Inf weights at load): the row is poisoned
    as it is read, by ``poisoned_strop.py`` in subprocesses and the ``poisoned_reads``
    fixture in this process."""
    make_tiny_checkpoint(directory, TEXTS, seed=0, layers=1)  # one layer: quicker compiles
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    token = tokenizer["model"]["vocab"][POISON]
    write_poison(directory, "model.embed_tokens.weight", token, value)
    return directory, token


@pytest.fixture(autouse=True)
def poisoned_reads(monkeypatch):
    install(monkeypatch.setattr)


def assert_all_finite(path: Path) -> None:
    tensors = load_file(path)
    assert tensors and all(np.isfinite(t).all() for t in tensors.values()), path


def error_line(stderr: str) -> str:
    """The one ``error:`` line a stopped run prints, last, with no traceback."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == lines[-1] and "Traceback" not in stderr, lines
    return errors[0]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


# --- SFT ------------------------------------------------------------------------------------

SFT_POISONED_STEPS = (3, 5)  # 1-based; batches are consecutive lines (data.shuffle=false)
SFT_BATCH = 4


@pytest.fixture(scope="module")
def sft_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite_sft")
    model_dir, token = poisoned_model(root / "model", np.inf)
    rng = np.random.default_rng(0)
    poisoned_lines = {(step - 1) * SFT_BATCH + 1 for step in SFT_POISONED_STEPS}
    with (root / "train.jsonl").open("w") as f:
        for line in range(6 * SFT_BATCH):
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            op = POISON if line in poisoned_lines else "+"
            prompt = f"Question: What is {a} {op} {b}?\nAnswer:"
            f.write(json.dumps({"prompt": prompt, "completion": f" {a + b}"}) + "\n")
    return model_dir, root / "train.jsonl", token


def sft_overrides(task, run_dir, backend, *extra):
    model_dir, train, _ = task
    return [
        f"backend={backend}", f"model.path={model_dir}", f"data.train_path={train}",
        "data.shuffle=false", "data.pad_to_multiple=16", f"run_dir={run_dir}",
        "sft.steps=6", f"sft.batch_size={SFT_BATCH}", "sft.micro_batch_size=2",
        "checkpoint.every_steps=2", "logging.every_steps=1", "logging.tensorboard=false",
        "optim.lr=1e-2", "mesh.fsdp=1", "mesh.tensor=-1", *extra,
    ]  # fmt: skip


def test_skipped_sft_step_leaves_params_and_optimizer_bit_identical(sft_task, tmp_path):
    from strop.data import Tokenizer, load_sft_examples, make_sft_batcher

    for backend in ("jax", "torch"):
        config = load_config("tiny", sft_overrides(sft_task, tmp_path / backend, backend))
        tokenizer = Tokenizer.from_pretrained(config.model.path)
        examples, _ = load_sft_examples(config.data.train_path, config.data, tokenizer)
        batcher = make_sft_batcher(examples, config.data, tokenizer, SFT_BATCH, config.seed)
        assert sft_task[2] in batcher.batch(2)["input_ids"]  # step 3 (0-based 2) is poisoned
        policy = _build_policy(config)
        for step in (0, 1):
            assert policy.train_step(batcher.batch(step), 2)["skipped"] == 0.0
        before = _trainable_and_optimizer(policy)
        metrics = policy.train_step(batcher.batch(2), 2)
        assert metrics["skipped"] == 1.0, (backend, metrics)
        assert not np.isfinite(metrics["loss"]) and not np.isfinite(metrics["grad_norm"])
        _assert_bit_identical(before, _trainable_and_optimizer(policy), backend)
        after_good = policy.train_step(batcher.batch(3), 2)  # a clean step still trains
        assert after_good["skipped"] == 0.0 and np.isfinite(after_good["loss"])
        changed = _trainable_and_optimizer(policy)
        assert any(not np.array_equal(before[k], changed[k]) for k in before), backend


def _build_policy(config):
    from strop.backends import get_backend

    return get_backend(config.backend).build_policy(config, PolicyRun(total_steps=6))


def _trainable_and_optimizer(policy) -> dict[str, np.ndarray]:
    """Host copies of every trainable parameter and every optimizer-state array."""
    if policy.backend == "jax":
        import jax
        from flax import nnx

        trees = {
            "param": nnx.state(policy.model, policy.trainable),
            "opt": policy.trainer.opt_state,
        }
        return {
            f"{kind}{jax.tree_util.keystr(path)}": np.array(leaf)
            for kind, tree in trees.items()
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        }
    out = {f"param/{n}": p.detach().cpu().numpy().copy() for n, p in _torch_trainable(policy)}
    for index, state in enumerate(policy.trainer.optimizer.state.values()):
        for name, value in state.items():
            out[f"opt/{index}/{name}"] = value.detach().cpu().numpy().copy()
    out["updates"] = np.array(policy.trainer.updates)
    return out


def _torch_trainable(policy):
    return [(n, p) for n, p in policy.model.named_parameters() if p.requires_grad]


def _assert_bit_identical(before, after, label) -> None:
    assert before.keys() == after.keys() and before, label
    for key in before:
        assert np.array_equal(before[key], after[key]), f"{label}: {key} changed"
        assert before[key].tobytes() == after[key].tobytes(), f"{label}: {key} bits changed"


@BACKENDS
def test_sft_nonfinite_stops_with_one_line_then_resumes_or_skips(sft_task, tmp_path, backend):
    # (a) no flag: exit 3 at the first poisoned step, one line, nothing saved after it
    stopped = tmp_path / "stopped"
    command = [*POISONED_STROP, "sft", "tiny",
               *sft_overrides(sft_task, stopped, backend)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_NONFINITE, done.stderr[-2000:]
    line = error_line(done.stderr)
    assert line.startswith("error: sft step 3: non-finite loss=nan grad_norm=nan;"), line
    assert "last complete checkpoint: step 2" in line and "train.skip_nonfinite=true" in line
    assert checkpoint_steps(stopped) == [2]
    assert [r["step"] for r in read_metrics(stopped / "metrics.jsonl")] == [1, 2]
    assert not (stopped / "adapter").exists()

    # the kept checkpoint loads and resumes (here with the flag, past both poisoned steps)
    resumed = run_sft(
        load_config("tiny", sft_overrides(sft_task, stopped, backend, "train.skip_nonfinite=true"))
    )
    assert resumed.resumed_from == 2 and resumed.final_step == 6

    # (b) with the flag from the start: the run finishes and counts exactly the poisoned steps
    skipping = tmp_path / "skipping"
    straight = run_sft(
        load_config("tiny", sft_overrides(sft_task, skipping, backend, "train.skip_nonfinite=true"))
    )
    records = read_metrics(skipping / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    counts = [r["train/nonfinite_skipped"] for r in records]
    assert counts == [0, 0, 1, 1, 2, 2]  # cumulative: poisoned steps 3 and 5
    assert [r["train/loss"] is None for r in records] == [
        s in SFT_POISONED_STEPS for s in range(1, 7)
    ]
    assert checkpoint_steps(skipping) == [4, 6]  # checkpoint.keep=2
    assert_all_finite(skipping / "adapter" / "adapter_model.safetensors")
    assert_all_finite(stopped / "adapter" / "adapter_model.safetensors")
    # the resumed run did what the uninterrupted one did from step 3 on
    np.testing.assert_array_equal(resumed.losses, straight.losses[2:])
    assert read_metrics(stopped / "metrics.jsonl")[-1]["train/nonfinite_skipped"] == 2


# --- PPO ------------------------------------------------------------------------------------

PPO_PROMPTS, PPO_PER_STEP, PPO_STEPS = 16, 4, 4
PPO_POISONED_ITERATIONS = (2, 4)  # 1-based


@pytest.fixture(scope="module")
def ppo_task(tmp_path_factory):
    """A NaN-embedding model and prompts where only iterations 2 and 4 draw a poisoned one
    (one critic and one policy update per iteration: the mini-batch is the whole batch)."""
    root = tmp_path_factory.mktemp("nonfinite_ppo")
    _, token = poisoned_model(root / "model", np.nan)
    draws = PromptSet([[0]] * PPO_PROMPTS, [""] * PPO_PROMPTS, [""] * PPO_PROMPTS)
    poisoned = {draws.draw(i - 1, PPO_PER_STEP, seed=0)[0] for i in PPO_POISONED_ITERATIONS}
    for iteration in set(range(1, PPO_STEPS + 1)) - set(PPO_POISONED_ITERATIONS):
        assert not poisoned & set(draws.draw(iteration - 1, PPO_PER_STEP, seed=0))
    rng = np.random.default_rng(0)
    with (root / "train.jsonl").open("w") as f:
        for index in range(PPO_PROMPTS):
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            op = POISON if index in poisoned else "+"
            record = {"question": f"What is {a} {op} {b}?", "answer": f"#### {a + b}"}
            f.write(json.dumps(record) + "\n")
    return root, token


def ppo_overrides(task, run_dir, backend, *extra):
    root, _ = task
    return [
        f"backend={backend}", f"model.path={root / 'model'}",
        f"data.train_path={root / 'train.jsonl'}", f"run_dir={run_dir}", "mesh.fsdp=1",
        "mesh.tensor=-1", f"ppo.steps={PPO_STEPS}", f"ppo.prompts_per_step={PPO_PER_STEP}",
        "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=8", "ppo.validate_every=0",
        "ppo.reward=format", "generation.max_new_tokens=8",
        "checkpoint.every_steps=1", "logging.tensorboard=false", *extra,
    ]  # fmt: skip


@BACKENDS
def test_ppo_nonfinite_stops_with_one_line_then_resumes_or_skips(ppo_task, tmp_path, backend):
    # (a) no flag: the critic update of iteration 2 (it runs first) stops the run
    stopped = tmp_path / "stopped"
    command = [*POISONED_STROP, "ppo", "ppo-lora-tiny",
               *ppo_overrides(ppo_task, stopped, backend)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_NONFINITE, done.stderr[-2000:]
    line = error_line(done.stderr)
    assert line.startswith(
        "error: ppo iteration 2 critic update (epoch 1, mini-batch 1): non-finite loss=nan"
    ), line
    assert "last complete checkpoint: step 1" in line and "train.skip_nonfinite=true" in line
    assert checkpoint_steps(stopped) == [1]
    assert [r["step"] for r in read_metrics(stopped / "metrics.jsonl")] == [1]

    # the kept checkpoint loads and resumes, with the flag
    flag = "train.skip_nonfinite=true"
    resumed = run_ppo(load_config("ppo-lora-tiny", ppo_overrides(ppo_task, stopped, backend, flag)))
    assert resumed.resumed_from == 1 and resumed.final_step == PPO_STEPS

    # (b) with the flag from the start: every poisoned update is skipped and counted
    skipping = tmp_path / "skipping"
    straight = run_ppo(
        load_config("ppo-lora-tiny", ppo_overrides(ppo_task, skipping, backend, flag))
    )
    records = read_metrics(skipping / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["critic/nonfinite_skipped"] for r in records] == [0, 1, 1, 2]
    assert [r["policy/nonfinite_skipped"] for r in records] == [0, 1, 1, 2]
    assert_all_finite(skipping / "adapter" / "adapter_model.safetensors")
    assert_all_finite(stopped / "adapter" / "adapter_model.safetensors")
    assert all(np.isfinite(v).all() for v in _flat(restored_weights(ppo_task, skipping, backend)))
    assert read_metrics(stopped / "metrics.jsonl")[-1]["critic/nonfinite_skipped"] == 2
    assert [r["train/reward"] for r in resumed.history] == [
        r["train/reward"] for r in straight.history[1:]
    ]


def restored_weights(task, run_dir: Path, backend: str):
    """Actor and critic adapters and the value head of the run's latest checkpoint."""

    config = load_config("ppo-lora-tiny", ppo_overrides(task, run_dir, backend))
    facts = preflight(config, run_kind("ppo"), exporting=True)  # as strop export restores it
    engine = build_trained_model(config, facts)
    engine.restore_checkpoint(engine.latest_checkpoint())
    return engine.lora_weights()


def _flat(tree) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _flat(v)]
    if isinstance(tree, list | tuple):
        return [x for v in tree for x in _flat(v)]
    return [np.asarray(tree)]


@BACKENDS
def test_skipped_ppo_updates_leave_weights_and_optimizers_bit_identical(
    ppo_task, tmp_path, backend
):
    from strop.backends import get_backend

    _, token = ppo_task
    config = load_config("ppo-lora-tiny", ppo_overrides(ppo_task, tmp_path, backend))
    engine = get_backend(backend).build_actor_critic(
        config, total_updates=4, plan=RolePlan.from_config(config), checkpoints=None
    )
    clean, poisoned = update_batch(engine, seed=0), update_batch(engine, seed=1, poison=token)
    for train in (engine.train_critic, engine.train_policy):  # optimizer state is not zero
        assert train(clean, 1)["skipped"] == 0.0
    before = ppo_state(engine)
    for train in (engine.train_critic, engine.train_policy):
        stats = train(poisoned, 1)
        assert stats["skipped"] == 1.0 and not np.isfinite(stats["loss"]), stats
    _assert_bit_identical(before, ppo_state(engine), backend)
    assert engine.train_critic(clean, 1)["skipped"] == 0.0  # clean updates still apply
    assert any(not np.array_equal(v, ppo_state(engine)[k]) for k, v in before.items())


def update_batch(engine, *, seed: int, poison: int | None = None, rows: int = 8, length: int = 16):
    """A mini-batch for ``train_critic`` and ``train_policy``; row 0 holds ``poison``."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(40, 200, (rows, length)).astype(np.int32)
    if poison is not None:
        ids[0, 3] = poison
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    weights = np.zeros((rows, length), np.float32)
    weights[:, 8:] = 1.0 / (rows * (length - 8))
    batch |= {
        "loss_weights": weights,
        "old_values": np.zeros((rows, length), np.float32),
        "returns": rng.standard_normal((rows, length)).astype(np.float32),
        "advantages": rng.standard_normal((rows, length)).astype(np.float32),
    }
    batch["old_logprobs"] = engine.logprobs(batch) + 0.01 * rng.standard_normal((rows, length))
    return batch


def ppo_state(engine) -> dict[str, np.ndarray]:
    """Host copies of actor, critic and value head weights and of both optimizers' state."""
    out = {
        f"weights/{key}": np.array(value)
        for key, value in _flat_named(engine.lora_weights(), "").items()
    }
    if engine.backend == "jax":
        import jax

        trees = {"actor_opt": engine.actor_opt, "critic_opt": engine.critic_opt}
        for kind, tree in trees.items():
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                out[f"{kind}{jax.tree_util.keystr(path)}"] = np.array(leaf)
        return out
    for role, trainer in (("actor", engine.actor_trainer), ("critic", engine.critic_trainer)):
        for index, state in enumerate(trainer.optimizer.state.values()):
            for name, value in state.items():
                out[f"{role}_opt/{index}/{name}"] = value.detach().cpu().numpy().copy()
        out[f"{role}_updates"] = np.array(trainer.updates)
    return out


def _flat_named(tree, prefix: str) -> dict[str, np.ndarray]:
    if isinstance(tree, dict):
        return {
            k: v
            for key, sub in tree.items()
            for k, v in _flat_named(sub, f"{prefix}/{key}").items()
        }
    if isinstance(tree, list | tuple):
        return {
            k: v for i, sub in enumerate(tree) for k, v in _flat_named(sub, f"{prefix}/{i}").items()
        }
    return {prefix: np.asarray(tree)}
