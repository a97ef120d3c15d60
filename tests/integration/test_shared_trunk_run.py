"""`strop ppo backend=torch critic.shared_trunk=true`: the run logs the policy's and the
critic's statistics from its one update per mini-batch, and a run killed and resumed
computes what an uninterrupted one does (the value head and the one optimizer that trains
it are in the checkpoint)."""

from __future__ import annotations

import random
import subprocess

import pytest

from strop.errors import CheckpointError
from strop.metrics.sinks import read_metrics
from strop.rl.ppo import run_ppo
from tests.integration.test_kill_resume import (
    PPO,
    _comparable,
    _env,
    _kill_and_resume,
    _metric_steps,
    jax_cache,  # noqa: F401 (a fixture)
    ppo_inputs,  # noqa: F401 (a fixture)
)
from tests.integration.test_ppo_run import (  # noqa: F401 (task: a fixture)
    assert_resumes_exactly,
    config_for,
    task,
)

pytestmark = pytest.mark.slow


@pytest.mark.acceptance  # make test-acceptance; make test resumes shared trunks in-process (below)
def test_a_shared_trunk_run_logs_both_roles_and_resumes_exactly(tmp_path, ppo_inputs, jax_cache):  # noqa: F811
    env = _env(jax_cache)
    common = [
        "backend=torch", "critic.shared_trunk=true", "ppo.steps=4", "ppo.prompts_per_step=4",
        "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=8", "ppo.validate_every=2",
        "ppo.validation_size=8", "generation.max_new_tokens=16", "checkpoint.every_steps=1",
        "checkpoint.keep=2", "logging.tensorboard=false", *ppo_inputs,
    ]  # fmt: skip
    straight = subprocess.run(
        [*PPO, f"run_dir={tmp_path / 'straight'}", *common], env=env, capture_output=True
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    want = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    trained = [r for r in want if "policy/loss" in r]
    assert len(trained) == 4
    for record in trained:
        for key in ("critic/loss", "critic/value_mean", "critic/explained_var", "policy/pg_loss",
                    "policy/grad_norm"):  # fmt: skip
            assert key in record, (key, sorted(record))
        assert "critic/grad_norm" not in record  # one update, one norm: policy/grad_norm
    assert len({r["critic/value_mean"] for r in trained}) > 1  # the head trains

    run_dir = tmp_path / "killed"
    kills, _, resumes = _kill_and_resume(
        [*PPO, f"run_dir={run_dir}", *common], env, run_dir / "checkpoints", "torch",
        1, 0.4, random.Random("shared-trunk-kill"), tmp_path,
    )  # fmt: skip
    assert kills == 1 and resumes == 1
    got = read_metrics(run_dir / "metrics.jsonl")
    assert _metric_steps(run_dir) == [r["step"] for r in want]
    assert [_comparable(r) for r in got] == [_comparable(r) for r in want]


@pytest.mark.parametrize(
    "first", [False, True], ids=["separate-then-shared", "shared-then-separate"]
)
def test_a_checkpoint_resumes_only_with_the_critic_it_was_written_with(task, tmp_path, first):  # noqa: F811
    """A separate critic's checkpoint holds a critic adapter and two optimizers, a shared
    trunk's neither: each refuses to resume as the other, in one error naming the key."""

    def config(shared: bool):
        return config_for(
            task, tmp_path / "run", "torch", f"critic.shared_trunk={str(shared).lower()}",
            "ppo.steps=2", "checkpoint.every_steps=1", "ppo.validate_every=0",
        )  # fmt: skip

    run_ppo(config(first), stop_after=1)
    with pytest.raises(CheckpointError, match="critic"):
        run_ppo(config(not first))


@pytest.mark.parametrize(  # JAX's run (35-40 s) in the acceptance tier; its shared-trunk
    "backend",  # update is held to torch's in make test (tests/parity/test_shared_trunk.py)
    [pytest.param("jax", marks=pytest.mark.acceptance), "torch"],
)
def test_a_shared_trunk_run_resumes_exactly_on_both_backends(task, tmp_path, backend):  # noqa: F811
    overrides = ("critic.shared_trunk=true", "ppo.steps=3", "checkpoint.every_steps=2",
                 "ppo.validate_every=0")  # fmt: skip
    straight = assert_resumes_exactly(task, tmp_path, backend, overrides, stop_after=2)
    trained = [r for r in straight.history if "policy/loss" in r]
    assert len(trained) == 3
    for record in trained:  # both roles logged, from one update with one norm
        for key in ("critic/loss", "critic/value_mean", "critic/explained_var", "policy/pg_loss",
                    "policy/grad_norm"):  # fmt: skip
            assert key in record, (key, sorted(record))
        assert "critic/grad_norm" not in record
    assert len({r["critic/value_mean"] for r in trained}) > 1  # the head trains
