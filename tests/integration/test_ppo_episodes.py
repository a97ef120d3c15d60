"""`strop ppo` with ``env.name``: multi-turn episodes on the shipped tiny-math model, on both
backends (GRPO on both, PPO with a critic on torch): the episodes' metrics and reward parts
are logged, the environment's tokens are holes in the response mask, the sampler's
log-probabilities line up with the trainer's over them, validation plays episodes, and a
run stopped after one iteration resumes to the metrics of a straight run (on torch: resuming
is backend-neutral here, the episodes' seeds being the iteration's). JAX runs on
test_ppo_run's one-layer model with no checkpoint but the last: a cold run on tiny-math
compiled for 50 s on 2 busy cores, this one for about half that.
A bad environment reference, or arguments its factory refuses, is one line (exit 2) before
any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import strop
from strop.config import load_config
from strop.data import Tokenizer
from strop.data.synthetic import make_problems
from strop.metrics.sinks import read_metrics
from strop.rl.ppo import PpoLoop, run_ppo
from tests.integration.test_ppo_run import comparable, task  # noqa: F401 (a fixture)
from tests.integration.test_reward_file_cli import cli_args

TINY_MATH = Path(strop.__file__).parent / "assets" / "tiny-math"
ENV_FILE = '''
from strop.agents.calculator import correct
from strop.agents.environment import StepResult


class TwoTurns:
    """Asks the model to check its answer once, then scores the episode: ``correct`` (its
    final answer) and ``digits`` (each turn's share of digits, summed over the turns)."""

    def reset(self, record):
        self.record = record
        return [{"role": "user", "content": f"Question: {record['question']}\\nAnswer:"}]

    def step(self, messages):
        text = messages[-1]["content"]
        digits = {"digits": sum(c.isdigit() for c in text) / max(len(text), 1)}
        if sum(m["role"] == "assistant" for m in messages) < 2:
            return StepResult([{"role": "user", "content": "Check it."}], digits, {"tool_calls": 1})
        return StepResult(None, {**digits, **correct(self.record, messages)})
'''
ENV_METRICS = {
    "env/turns", "env/tool_calls", "env/tool_errors", "env/truncated", "env/errors",
    "env/episode_tokens", "reward/correct", "reward/digits", "train/reward",
}  # fmt: skip
# GAE with the sampler's log-probabilities as the old ones, GRPO with them recomputed: either
# way they must line up with the trainer's over the episode, holes and all.
ESTIMATORS = {"gae": ("ppo.old_logprobs=sampler",), "grpo": ("ppo.advantage_estimator=grpo",)}


@pytest.fixture(scope="module")
def episodes_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_episodes")
    problems = make_problems(6, seed=0, max_steps=1)
    for name, records in (("train", problems[:4]), ("val", problems[4:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "two_turns.py").write_text(ENV_FILE)
    return root


def config_for(root, run_dir, backend, *overrides, model=TINY_MATH):
    return load_config(
        "ppo-lora-tiny",
        [
            f"model.path={model}", f"data.train_path={root / 'train.jsonl'}",
            f"data.eval_path={root / 'val.jsonl'}", f"run_dir={run_dir}", f"backend={backend}",
            "mesh.fsdp=1", "mesh.tensor=-1", f"env.name={root / 'two_turns.py'}:TwoTurns",
            "ppo.reward=none", "env.max_episode_tokens=200", "generation.max_new_tokens=8",
            "ppo.steps=2", "ppo.prompts_per_step=2", "ppo.num_generations_per_prompt=2",
            "ppo.mini_batch_size=4", "ppo.validate_every=2", "ppo.validation_size=2",
            "checkpoint.every_steps=1", "logging.samples=1", *overrides,
        ],
    )  # fmt: skip


# Each backend with one estimator (the episode sampling is the core's whatever the estimator):
# JAX the grouped critic-free path, torch the critic's with validation and a resume.
@pytest.mark.parametrize(
    ("backend", "estimator", "validate"), [("jax", "grpo", False), ("torch", "gae", True)]
)
def test_ppo_trains_on_episodes_and_a_stopped_run_resumes_exactly(
    task,  # noqa: F811
    episodes_task,
    tmp_path,
    monkeypatch,
    backend,
    estimator,
    validate,
):
    samples, experience = [], PpoLoop._experience

    def spy(self, sample):
        samples.append(sample)
        return experience(self, sample)

    monkeypatch.setattr(PpoLoop, "_experience", spy)
    overrides = (*ESTIMATORS[estimator], f"ppo.validate_every={2 if validate else 0}")
    if backend == "torch":  # a trainer reward beside the environment's parts, through run_ppo
        overrides = (*overrides, "ppo.reward=[{reward: format, weight: 0.5}]")
    model = TINY_MATH
    if backend == "jax":
        model, overrides = task / "model", (*overrides, "checkpoint.every_steps=100")
    config = config_for(episodes_task, tmp_path / "straight", backend, *overrides, model=model)
    straight = run_ppo(config)
    written = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in written] == ([0, 1, 2] if validate else [1, 2])
    for record in written[-2:]:
        assert record.keys() >= ENV_METRICS, ENV_METRICS - record.keys()
        assert record["env/turns"] == 2.0 and record["env/tool_calls"] == 1.0
        assert record["env/errors"] == 0.0 and record["env/truncated"] == 0.0
        trainer = {
            "reward/format",
            "reward/calls",
            "reward/items",
        }  # ppo.reward's, with its counters
        assert (trainer <= record.keys()) == (backend == "torch"), record.keys()
    first = written[-2]
    if estimator == "grpo":  # before the first update, the sampler's = the trainer's
        assert abs(first["token_mult_prob_error"] - 1.0) < 1e-4
    else:  # measured on the first update, whose policy is still the sampler's
        assert first["mismatch/abs_logprob_diff_max"] < 1e-3
    if validate:
        assert "validation/accuracy" in written[0] and "validation/accuracy" in written[-1]
        logged = (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()[0]
        assert "Check it." in json.loads(logged)["response"]
    # The environment's turn is a hole in each row's response mask: context, not a target.
    tok = Tokenizer.from_pretrained(model)
    rollout = samples[0].rollout
    assert len(rollout) == 4 and not samples[0].no_loss.any()
    for row in range(len(rollout)):
        n = int(rollout.lengths[row])
        mask, ids = rollout.response_mask[row, :n], rollout.response_ids[row, :n]
        assert mask[0] == 1 and mask[-1] == 1 and (np.diff(mask) > 0).sum() == 1
        assert "Check it." in tok.decode(ids[mask == 0].tolist())
        assert "Check it." not in tok.decode(ids[mask == 1].tolist())

    if backend == "jax":
        return
    config = config_for(episodes_task, tmp_path / "resumed", backend, *overrides)
    run_ppo(config, stop_after=1)
    resumed = run_ppo(config)
    assert resumed.resumed_from == 1
    assert [comparable(r) for r in resumed.history] == [comparable(r) for r in straight.history[1:]]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            ("env.name=nothere.py:make", "ppo.reward=none"),
            "error: env.name: environment 'nothere.py:make': ",
        ),
        (("env.name=two_turns.py:TwoTurn", "ppo.reward=none"), "did you mean 'TwoTurns'?"),
        (("env.name=calculater", "ppo.reward=none"), "unknown built-in environment; the built"),
        (("env.name=calculator",), "set ppo.reward=none"),  # the recipe sets ppo.reward
        (
            ("env.name=calculator", "ppo.reward=none", "env.args={turns: 2}"),
            "error: env.name: environment 'calculator': calculator_environment(...) failed: ",
        ),
    ],
    ids=["missing-file", "missing-factory", "unknown-built-in", "reward-too", "bad-args"],
)
def test_a_bad_environment_is_one_line_before_any_model_loads(
    task,  # noqa: F811
    episodes_task,
    tmp_path,
    monkeypatch,
    capsys,
    no_model_builds,
    extra,
    said,
):
    from strop.cli import main

    monkeypatch.chdir(episodes_task)
    with pytest.raises(SystemExit) as info:
        main(cli_args(task, tmp_path / "run", "torch", *extra))
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and said in lines[0], lines
