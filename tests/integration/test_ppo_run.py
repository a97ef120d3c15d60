"""`strop ppo` end to end on a tiny model, on both backends: learning, metrics, CLI.

(Resume: ``test_kill_resume.py`` kills PPO runs on both backends and holds every
iteration's metrics to an uninterrupted run's.)

The functional check uses a tiny *random* Qwen2, so its reward must be learnable from
scratch in a few iterations: ``digit_share`` (the fraction of a response's characters
that are digits), registered here. The reward rises by a stated margin within a fixed
number of iterations with fixed seeds. (The GSM8K-style math task with a pretrained tiny
model is `strop demo`'s job.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from strop import rewards
from strop.config import load_config
from strop.io.tiny import make_tiny_checkpoint
from strop.metrics.sinks import read_metrics
from strop.rl.ppo import run_ppo
from tests.run_facts import ONCE_EACH, counting_run_facts

BACKENDS = ("jax", "torch")
REQUIRED_METRICS = {
    "train/reward", "train/response_length", "policy/loss", "policy/clipfrac", "policy/kl",
    "policy/entropy", "policy/grad_norm", "critic/loss", "critic/explained_var",
    "critic/grad_norm", "critic/value_mean", "token_mult_prob_error", "mismatch/kl",
    "mismatch/abs_logprob_diff_mean", "mismatch/abs_logprob_diff_max", "timing/generate",
    "timing/logprobs", "timing/values", "timing/train",
    "throughput/tokens_per_s", "reward/timeouts",
}  # fmt: skip
MISMATCH = {"mismatch/kl", "mismatch/abs_logprob_diff_mean", "mismatch/abs_logprob_diff_max"}
"""The mismatch monitor: in every PPO/GRPO iteration's metrics."""
MARGIN = 0.1  # train/reward: mean of the last 3 iterations >= mean of the first 3 + this


@rewards.register("digit_share", replace=True)
def digit_share(prompts, completions, **columns):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_task")
    rng = np.random.default_rng(0)
    for name, count in (("train", 64), ("val", 8)):
        with (root / f"{name}.jsonl").open("w") as f:
            for _ in range(count):
                a, b = (int(x) for x in rng.integers(0, 10, 2))
                record = {
                    "question": f"What is {a} + {b}?",
                    "answer": f"{a}+{b}={a + b}\n#### {a + b}",
                }
                f.write(json.dumps(record) + "\n")
    texts = [f"Question: What is {a} + {b}?\nAnswer: {a + b}" for a in range(10) for b in range(10)]
    # one layer: these runs check what PPO writes and keeps, and a layer fewer compiles faster
    make_tiny_checkpoint(root / "model", texts, seed=0, layers=1)
    return root


def config_for(task, run_dir, backend, *overrides):
    return load_config(
        "ppo-lora-tiny",
        [
            f"model.path={task / 'model'}",
            f"data.train_path={task / 'train.jsonl'}",
            f"data.eval_path={task / 'val.jsonl'}",
            f"run_dir={run_dir}",
            f"backend={backend}",
            "mesh.fsdp=1",
            "mesh.tensor=-1",
            "generation.max_new_tokens=16",
            "lora.target_modules=['.*_proj','lm_head']",
            *overrides,
        ],
    )


def test_a_ppo_run_reads_its_facts_once_before_step_1(task, tmp_path, monkeypatch):
    """The model's config.json, the role plan's job identity and the checkpoint listing:
    read once, at preflight, and handed on (issue 46)."""
    with counting_run_facts(monkeypatch) as counts:
        run_ppo(config_for(task, tmp_path, "torch"), stop_after=0)
    assert counts == ONCE_EACH


@pytest.mark.parametrize("backend", BACKENDS)
def test_reward_rises_on_both_backends(task, tmp_path, backend):
    config = config_for(
        task, tmp_path / "run", backend,
        "ppo.reward=digit_share", "ppo.steps=12", "ppo.validate_every=0",
        "optim.lr=3e-2", "critic.lr=1e-2", "ppo.ppo_epochs=2", "checkpoint.every_steps=100",
        "logging.every_steps=5",
    )  # fmt: skip
    result = run_ppo(config)
    rewards_seen = [record["train/reward"] for record in result.history]
    assert len(rewards_seen) == 12
    # logging.every_steps, and the last iteration (PPO wrote every iteration before)
    written = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [record["step"] for record in written] == [5, 10, 12]
    assert written[-1]["train/reward"] == rewards_seen[-1]
    assert np.mean(rewards_seen[-3:]) >= np.mean(rewards_seen[:3]) + MARGIN, rewards_seen
    assert result.history[-1].keys() >= REQUIRED_METRICS
    # nothing was changed between sampling and the first forward
    assert abs(result.history[0]["token_mult_prob_error"] - 1.0) < 1e-4
    assert (result.export_path / "adapter_config.json").is_file()


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing/", "throughput/"))}


def test_cli_ppo_writes_metrics_checkpoints_and_the_adapter(task, tmp_path):
    run_dir = tmp_path / "cli"
    strop = [sys.executable, "-m", "strop"]
    recipe = [
        "ppo-lora-tiny",
        f"model.path={task / 'model'}", f"data.train_path={task / 'train.jsonl'}",
        f"data.eval_path={task / 'val.jsonl'}", f"run_dir={run_dir}", "backend=torch",
        "ppo.steps=2", "ppo.validate_every=1", "checkpoint.every_steps=1",
        "generation.max_new_tokens=8",
    ]  # fmt: skip
    export = [*strop, "export", *recipe, "--adapter", "--out", str(tmp_path / "exported")]
    nothing_yet = subprocess.run(export, capture_output=True, text=True, timeout=300)
    assert nothing_yet.returncode == 2, nothing_yet.stderr[-2000:]
    assert nothing_yet.stderr.splitlines()[-1].startswith("error: no torch checkpoint in ")
    done = subprocess.run([*strop, "ppo", *recipe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "validation/accuracy" in records[0] and "train/reward" in records[2]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [0] * 4 + [1] * 4 + [2] * 4  # logging.samples=4
    assert set(samples[0]) == {"step", "prompt", "response", "extracted", "gold", "reward"}
    assert all(r["prompt"] and r["reward"] in (0.0, 1.0) for r in samples)
    events = b"".join(p.read_bytes() for p in (run_dir / "tensorboard").iterdir())
    assert (
        b"validation/samples" in events
        and samples[0]["prompt"].replace("\n", "<br>").encode() in events
    )
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]
    plotted = subprocess.run([sys.executable, "-m", "strop", "plot", str(run_dir)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert (run_dir / "plot.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    exported = subprocess.run(export, capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "exported the actor of PPO step 2" in exported.stdout
    assert (tmp_path / "exported" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_of_a_ppo_run_is_its_actor(task, tmp_path, backend):
    """`strop export` on a PPO run restores the newest checkpoint and writes the actor: the
    adapter PPO itself exported, or a merged model whose logits (in `transformers`) are
    the base + that adapter's (in PEFT); the critic's adapter and head stay out."""
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from strop.commands.export import run_export

    run_dir = tmp_path / "run"
    config = config_for(
        task, run_dir, backend, "ppo.steps=2", "ppo.validate_every=0", "optim.lr=1e-2"
    )
    run_ppo(config)
    adapter = run_export(config, tmp_path / "adapter", merged=False)
    assert (adapter.job, adapter.step) == ("ppo", 2)
    ours = load_file(adapter.path / "adapter_model.safetensors")
    at_the_end = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert ours.keys() == at_the_end.keys()
    assert all(np.array_equal(ours[k], at_the_end[k]) for k in ours)

    merged = run_export(config, tmp_path / "merged", merged=True)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    load = AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        plain = load(task / "model", dtype=torch.float32)(ids).logits
        via_peft = PeftModel.from_pretrained(load(task / "model", dtype=torch.float32),
                                             run_dir / "adapter").eval()(ids).logits  # fmt: skip
        via_merged = load(merged.path, dtype=torch.float32)(ids).logits
    assert (via_peft - via_merged).abs().max() < 1e-4
    assert (via_peft - plain).abs().max() > 1e-4, "the actor did not move; the test shows nothing"


def test_ppo_refuses_greedy_rollouts_before_loading_anything(task, tmp_path):
    command = [
        sys.executable, "-m", "strop", "ppo", "ppo-lora-tiny", "model.path=/nonexistent",
        f"data.train_path={task / 'train.jsonl'}", "generation.temperature=0",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "generation.temperature" in done.stderr and "Traceback" not in done.stderr


def test_without_a_kl_the_reference_forward_is_skipped_and_nothing_else_changes(
    task, tmp_path, monkeypatch
):
    """kl_coef=0 (the demo): the reference log-probs were computed, then thrown away."""
    from strop.backends.torch.actor_critic import TorchActorCritic

    calls = []
    logprobs = TorchActorCritic.logprobs

    def counted(self, batch, reference=False):
        calls.append(reference)
        return logprobs(self, batch, reference=reference)

    monkeypatch.setattr(TorchActorCritic, "logprobs", counted)
    overrides = (
        "ppo.steps=2",
        "ppo.kl_coef=0",
        "ppo.validate_every=0",
        "checkpoint.every_steps=100",
    )
    skipped = run_ppo(config_for(task, tmp_path / "skipped", "torch", *overrides))
    assert True not in calls and calls.count(False) == 2  # one actor forward per iteration
    calls.clear()
    logged = run_ppo(config_for(task, tmp_path / "logged", "torch", *overrides, "ppo.log_kl=true"))
    assert calls.count(True) == 2
    assert logged.history[0]["policy/kl"] == 0.0  # the adapter starts at B = 0: ref = actor
    assert logged.history[1]["policy/kl"] != 0.0
    for without, with_reference in zip(skipped.history, logged.history, strict=True):
        assert "policy/kl" not in without
        assert comparable(without) == {
            k: v for k, v in comparable(with_reference).items() if k != "policy/kl"
        }


@pytest.mark.parametrize("backend", BACKENDS)
def test_old_logprobs_from_the_sampler_train_as_recomputed_ones(task, tmp_path, backend):
    """``ppo.old_logprobs=sampler`` skips the actor's forward and trains the same: the
    native samplers' log-probabilities are the trainer's (float32), so two iterations
    (the second sampled from the updated actor) give the same metrics. The recomputing
    run has ``ppo.rollout_correction=tis`` too: its weights are 1 up to float rounding
    there, so it trains the same. Both write the mismatch monitor's metrics (``mismatch/*``:
    in sampler mode, from the first update's forward)."""
    overrides = ("ppo.steps=2", "ppo.validate_every=0", "ppo.kl_coef=0.0")
    recomputed = run_ppo(
        config_for(task, tmp_path / "recompute", backend, *overrides, "ppo.rollout_correction=tis")
    )
    sampled = run_ppo(
        config_for(task, tmp_path / "sampler", backend, *overrides, "ppo.old_logprobs=sampler")
    )
    assert "timing/logprobs" in recomputed.history[0]
    assert "timing/logprobs" not in sampled.history[0]  # no forward: no time spent on it
    assert "token_mult_prob_error" not in sampled.history[0]  # nothing to compare with
    monitor = MISMATCH
    correction = {"mismatch/is_weight_mean", "mismatch/masked_fraction"}
    for run in ("recompute", "sampler"):
        for record in read_metrics(tmp_path / run / "metrics.jsonl"):
            assert monitor | (correction if run == "recompute" else set()) <= record.keys()
    assert not any(k.startswith("policy/mismatch") for k in sampled.history[0])
    for record in recomputed.history:
        assert record["mismatch/masked_fraction"] == 0
        assert record["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    only_recomputed = {"token_mult_prob_error", *correction}
    for expected, got in zip(recomputed.history, sampled.history, strict=True):
        assert comparable(got).keys() == comparable(expected).keys() - only_recomputed
        for key, value in comparable(got).items():
            np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-5, err_msg=key)


def assert_resumes_exactly(task, tmp_path, backend, overrides, *, stop_after: int):
    """A run stopped after ``stop_after`` iterations and resumed logs what an uninterrupted
    one does from there on; returns the uninterrupted run's result."""
    straight = run_ppo(config_for(task, tmp_path / "straight", backend, *overrides))
    config = config_for(task, tmp_path / "resumed", backend, *overrides)
    run_ppo(config, stop_after=stop_after)
    resumed = run_ppo(config)
    assert resumed.resumed_from == stop_after
    assert [comparable(r) for r in resumed.history] == [
        comparable(r) for r in straight.history[stop_after:]
    ]
    return straight


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grpo_run_trains_without_a_critic_and_resumes_exactly(task, tmp_path, backend):
    overrides = (
        "ppo.advantage_estimator=grpo", "ppo.kl_in_reward=false", "ppo.steps=3",
        "checkpoint.every_steps=2", "ppo.validate_every=0", "ppo.reward=digit_share",
    )  # fmt: skip
    straight = assert_resumes_exactly(task, tmp_path, backend, overrides, stop_after=2)
    record = straight.history[-1]
    assert not [key for key in record if key.startswith(("critic/", "timing/values"))]
    assert {"policy/loss", "policy/kl", "train/equal_score_groups"} <= record.keys()
    for written in read_metrics(tmp_path / "straight" / "metrics.jsonl"):
        assert written.keys() >= MISMATCH
    assert (straight.export_path / "adapter_config.json").is_file()

    # `strop export RUN_DIR`: the run's config.yaml says it had no critic (the recipe alone
    # said "critic is False in the checkpoint but None now")
    from safetensors.numpy import load_file

    from strop.commands.export import export_config, run_export

    exported = run_export(export_config(str(tmp_path / "straight")), tmp_path / "out", merged=False)
    assert (exported.job, exported.step) == ("ppo", 3)
    ours = load_file(exported.path / "adapter_model.safetensors")
    at_the_end = load_file(straight.export_path / "adapter_model.safetensors")
    assert ours.keys() == at_the_end.keys()
    assert all(np.array_equal(ours[k], at_the_end[k]) for k in ours)


DR_GRPO = ("grpo", "ppo.grpo_std_normalize=false", "ppo.loss_aggregation=seq_mean_token_sum_norm")


@pytest.mark.parametrize("estimator", [("rloo",), ("reinforce_pp",), DR_GRPO], ids=str)
def test_the_other_critic_free_estimators_run(task, tmp_path, estimator):
    name, *extra = estimator
    config = config_for(
        task, tmp_path / "run", "torch", f"ppo.advantage_estimator={name}", *extra,
        "ppo.kl_in_reward=false", "ppo.steps=2", "ppo.validate_every=0",
    )  # fmt: skip
    result = run_ppo(config)
    assert len(result.history) == 2
    assert not [key for key in result.history[-1] if key.startswith("critic/")]
    assert all(r.keys() >= MISMATCH for r in read_metrics(tmp_path / "run" / "metrics.jsonl"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_critic_warmup_updates_the_critic_alone_then_both(task, tmp_path, backend):
    """``ppo.critic_warmup_steps=1``: the first iteration updates the critic alone (its own
    call), the second the critic and the policy (one call, one program on JAX)."""
    config = config_for(
        task, tmp_path / "run", backend, "ppo.critic_warmup_steps=1", "ppo.steps=2",
        "ppo.validate_every=0", "checkpoint.every_steps=100",
    )  # fmt: skip
    first, second = run_ppo(config).history
    assert first["critic/grad_norm"] > 0 and second["critic/grad_norm"] > 0
    assert "policy/loss" not in first and "policy/grad_norm" not in first
    assert second["policy/grad_norm"] > 0
    assert first["timing/train"] > 0 and second["timing/train"] > 0


@pytest.mark.parametrize("overlong", ["mask", "penalty"])
def test_truncated_responses_are_masked_or_penalised(task, tmp_path, overlong):
    config = config_for(
        task, tmp_path / "run", "torch", f"ppo.overlong={overlong}", "ppo.overlong_buffer=8",
        "ppo.steps=2", "ppo.validate_every=0", "generation.max_new_tokens=8",
    )  # fmt: skip
    record = run_ppo(config).history[-1]
    assert record["train/truncated_fraction"] > 0  # 8 tokens: the random model runs long
    if overlong == "penalty":
        assert -1.0 <= record["train/overlong_penalty"] < 0
    else:
        assert "train/overlong_penalty" not in record
