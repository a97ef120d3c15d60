"""A reward function from a `.py` file drives `strop ppo` through the CLI on both backends
(weighted with a built-in, each logged as reward/<name>); a bad reference is refused in one
line before any model is built, and a function returning the wrong number of scores, or
hanging past ppo.reward_timeout_s, stops the run with one line naming it; `strop eval`
takes one too, and counts its errors. The tiny model and prompts
are test_ppo_run's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_ppo_run import task  # noqa: F401 (a fixture)

REWARD_FILE = '''
def digits(prompts, completions, answer, question, **columns):
    """The share of digits in a response; reads two of the records' columns."""
    if not all(q.startswith("What is") and "####" in a for q, a in zip(question, answer)):
        raise ValueError("the record columns did not arrive")
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def one(prompts, completions, **columns):
    return [1.0]


def hangs(prompts, completions, **columns):
    import time

    time.sleep(3600)
'''
WEIGHTED = "ppo.reward=[{reward: my_reward.py:digits, weight: 1.0}, {reward: format, weight: 0.5}]"


def cli_args(task, run_dir, backend, *extra):  # noqa: F811 (task: the fixture's value)
    return [
        "ppo", "ppo-lora-tiny",
        f"model.path={task / 'model'}", f"data.train_path={task / 'train.jsonl'}",
        f"run_dir={run_dir}", f"backend={backend}", "mesh.fsdp=1", "mesh.tensor=-1",
        "generation.max_new_tokens=8", "ppo.steps=2", "ppo.validate_every=0",
        "checkpoint.every_steps=100", *extra,
    ]  # fmt: skip


def strop(args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "strop", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


ESTIMATORS = {"gae": (), "grpo": ("ppo.advantage_estimator=grpo", "ppo.kl_in_reward=false")}


# The file's function runs in the core's reward worker whatever the backend and estimator:
# each backend with one estimator, the other half of the cross (make test's time, issue 34).
# JAX's half in the acceptance tier (24-36 s of `make test`): the reward file is read and
# called by the core, the same on both backends; JAX PPO through the CLI is test_ppo_run's.
@pytest.mark.parametrize(
    ("backend", "estimator"),
    [pytest.param("jax", "gae", marks=pytest.mark.acceptance), ("torch", "grpo")],
)
def test_a_reward_from_a_file_drives_ppo_through_the_cli(task, tmp_path, backend, estimator):  # noqa: F811
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    run_dir = tmp_path / "run"
    done = strop(cli_args(task, run_dir, backend, WEIGHTED, *ESTIMATORS[estimator]), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["reward/errors"] == 0 and record["reward/items"] == 32
        total = record["reward/digits"] + 0.5 * record["reward/format"]
        assert record["train/reward"] == pytest.approx(total, abs=1e-6)
    assert any(r["reward/digits"] > 0 for r in records)  # a random model writes some digits


@pytest.mark.parametrize(
    ("reward", "said"),
    [
        ("nothere.py:digits", "nothere.py does not exist (relative to "),
        ("my_reward.py:digit", "my_reward.py has no function 'digit', did you mean 'digits'?"),
        ("no_such_pkg.mod:f", "no module named 'no_such_pkg' on the Python path"),
    ],
    ids=["missing-file", "missing-function", "missing-module"],
)
@pytest.mark.parametrize("command", ["ppo", "eval"])
def test_a_bad_reference_is_one_line_before_any_model_loads(
    task,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
    no_model_builds,
    command,
    reward,
    said,
):
    from strop.cli import main

    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    key = "ppo.reward" if command == "ppo" else "eval.reward"
    args = cli_args(task, tmp_path / "run", "torch", f"{key}={reward}")
    if command == "eval":
        args = ["eval", "tiny", *args[2:], f"eval.path={task / 'val.jsonl'}"]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {key}={reward!r}: ") and said in lines[0], lines


STOPS = {
    "one": "returned 1 score(s) for 32 completion(s); a reward function returns one float per "
    "completion, in order",
    # before: 11 minutes of "step 1 running for 10m50s" and counting
    "hangs": "did not return within ppo.reward_timeout_s=2 s on 32 completion(s); its worker "
    "process was killed. Make it faster, or raise ppo.reward_timeout_s (0: no deadline, "
    "called in the trainer)",
}


@pytest.mark.parametrize("function", STOPS)
def test_a_reward_that_breaks_the_contract_or_hangs_stops_the_run_in_one_line(
    task,  # noqa: F811
    tmp_path,
    function,
):
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    args = cli_args(
        task, tmp_path / "run", "torch", f"ppo.reward=my_reward.py:{function}",
        "ppo.reward_timeout_s=2",
    )  # fmt: skip
    done = strop(args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"error: reward '{function}' (my_reward.py:{function}) {STOPS[function]}"), (
        done.stderr[-3000:]
    )


def test_eval_takes_a_reward_from_a_file(task, tmp_path, monkeypatch):  # noqa: F811
    """Correct (1.0) only where the record's columns reached the function (in its worker
    process); its NaN scores are wrong and counted in the summary."""
    from strop.commands.evaluation import run_eval
    from strop.config import load_config

    (tmp_path / "my_reward.py").write_text(
        "def columns_arrived(prompts, completions, question, answer, **columns):\n"
        "    return [float(q.startswith('What is') and '####' in a) if i % 2 == 0\n"
        "            else float('nan') for i, (q, a) in enumerate(zip(question, answer))]\n"
    )
    monkeypatch.chdir(tmp_path)
    config = load_config(
        "tiny",
        [f"model.path={task / 'model'}", f"eval.path={task / 'val.jsonl'}",
         f"run_dir={tmp_path / 'eval'}", "backend=torch", "eval.reward=my_reward.py:columns_arrived",
         "generation.max_new_tokens=4", "mesh.fsdp=1", "mesh.data=-1"],
    )  # fmt: skip
    result = run_eval(config)
    assert result.examples == 8 and result.accuracy == 0.5 and result.reward_errors == 4
    summary = json.loads((tmp_path / "eval" / "eval" / "summary.json").read_text())
    assert summary["reward_errors"] == 4 and summary["accuracy"] == 0.5
