"""`strop eval`: greedy responses, scoring, pass@k and outputs, on both backends."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from strop.commands.evaluation import run_eval
from strop.config import load_config
from strop.io.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def eval_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    questions = [f"Tom has {a} apples and buys {a + 3} more. How many now?" for a in range(6)]
    with (root / "test.jsonl").open("w") as f:
        for a, question in enumerate(questions):
            answer = f"He has {a} + {a + 3} = {2 * a + 3}.\n#### {2 * a + 3}"
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    make_tiny_checkpoint(root / "model", [*questions, "0 1 2 3 4 5 6 7 8 9 ####"], seed=0)
    return root


def config_for(root, run_dir, data=None, *overrides):
    return load_config(
        "tiny",
        [
            f"model.path={root / 'model'}",
            f"eval.path={data or root / 'test.jsonl'}",
            f"run_dir={run_dir}",
            "generation.max_new_tokens=12",
            "eval.batch_size=4",
            "mesh.fsdp=1",
            "mesh.data=-1",
            *overrides,
        ],
    )


def read_results(run_dir):
    lines = (run_dir / "eval" / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_greedy_eval_scores_what_the_model_says_on_both_backends(eval_inputs, tmp_path):
    results = {}
    for backend in ("jax", "torch"):
        run_dir = tmp_path / backend
        summary = run_eval(config_for(eval_inputs, run_dir, None, f"backend={backend}"))
        assert summary.examples == 6 and summary.samples_per_example == 1
        results[backend] = read_results(run_dir)
        assert json.loads((run_dir / "eval" / "summary.json").read_text())["examples"] == 6
    # Greedy decoding is the same model on both backends: the same responses.
    assert [r["responses"] for r in results["jax"]] == [r["responses"] for r in results["torch"]]

    # Make the gold of every even example what the model answered: those, and only those,
    # must now count as solved.
    first = results["jax"]
    expected = [r["index"] % 2 == 0 and r["extracted"][0] is not None for r in first]
    rigged = tmp_path / "rigged.jsonl"
    original = [json.loads(x) for x in (eval_inputs / "test.jsonl").read_text().splitlines()]
    with rigged.open("w") as f:
        for record, line, hit in zip(first, original, expected, strict=True):
            gold = record["extracted"][0] if hit else "987654321"
            f.write(json.dumps({"question": line["question"], "answer": f"#### {gold}"}) + "\n")
    summary = run_eval(config_for(eval_inputs, tmp_path / "rigged", rigged))
    assert [r["solved"] for r in read_results(tmp_path / "rigged")] == expected
    assert summary.pass_at_k == pytest.approx(sum(expected) / 6)
    assert sum(expected) >= 1, "the tiny model said no number at all; the test proves little"


def test_pass_at_k_samples_several_responses(eval_inputs, tmp_path):
    summary = run_eval(
        config_for(eval_inputs, tmp_path, None, "eval.num_samples=3", "eval.temperature=1.0")
    )
    records = read_results(tmp_path)
    assert summary.samples_per_example == 3
    assert all(len(r["responses"]) == 3 and len(r["correct"]) == 3 for r in records)
    assert summary.pass_at_k >= summary.accuracy


def test_cli_eval_prints_a_summary_and_bad_input_is_one_line(eval_inputs, tmp_path):
    cmd = [sys.executable, "-m", "strop", "eval", "tiny", f"model.path={eval_inputs / 'model'}",
           f"eval.path={eval_inputs / 'test.jsonl'}", f"run_dir={tmp_path}",
           "generation.max_new_tokens=4", "eval.max_examples=2", "mesh.fsdp=1", "mesh.data=-1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "accuracy" in done.stdout and "per-example results" in done.stdout
    assert len(read_results(tmp_path)) == 2
    bad = subprocess.run([*cmd, "eval.num_samples=4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "needs eval.temperature > 0" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


# --- env.name: episodes ----------------------------------------------------------------

ENV_KEYS = {"env/turns", "env/tool_calls", "env/tool_errors", "env/truncated", "env/errors"}


@pytest.fixture(scope="module")
def calc_inputs(tmp_path_factory):
    """The shipped tiny-calc agent and 6 calculator problems (greedy, it calls the tool for
    some phrasings and guesses for the others)."""
    from strop.agents.calculator_tasks import write_calc_splits

    return write_calc_splits(tmp_path_factory.mktemp("calc"), seed=0, n_train=1, n_validation=6)


def calc_overrides(data, run_dir, backend):
    from strop.assets import tiny_calc_path

    return [
        f"model.path={tiny_calc_path()}", f"eval.path={data}", f"run_dir={run_dir}",
        f"backend={backend}", "env.name=calculator", "env.max_episode_tokens=320",
        "generation.max_new_tokens=40", "eval.batch_size=6", "mesh.fsdp=1", "mesh.data=-1",
    ]  # fmt: skip


def test_eval_plays_episodes_and_counts_what_ppo_validation_counts(calc_inputs, tmp_path, capsys):
    """Both backends play the same greedy episodes (torch through the CLI's command: its
    table); they are what strop ppo's validation (:meth:`Episodes.validate`) plays and
    counts on the same weights."""
    from strop.backends import get_backend
    from strop.cli import evaluate
    from strop.data import Tokenizer
    from strop.generation import SamplingParams
    from strop.io.model_spec import read_model_spec, response_end_ids
    from strop.rl.episodes import Episodes
    from strop.rl.prompts import PromptSet
    from strop.run.preflight import check_environment

    data, results = calc_inputs["validation"], {}
    run_eval(load_config("tiny", calc_overrides(data, tmp_path / "jax", "jax")))
    evaluate("tiny", calc_overrides(data, tmp_path / "torch", "torch"))
    table = capsys.readouterr().out
    assert "env/tool_calls" in table and "ended by the environment" in table, table
    for backend in ("jax", "torch"):
        summary = json.loads((tmp_path / backend / "eval" / "summary.json").read_text())
        records = results[backend] = read_results(tmp_path / backend)
        assert summary["examples"] == 6 and len(records) == 6
        assert summary["metrics"].keys() >= ENV_KEYS | {"reward/correct"}
        assert summary["metrics"]["env/tool_calls"] > 0, "no tool call: the test proves little"
        assert all(r["correct"] == [r["rewards"][0].get("correct", 0) >= 1] for r in records)
    assert results["jax"] == results["torch"]

    # What strop ppo's validation (Episodes.validate, greedy) counts on the same weights.
    config = load_config("tiny", calc_overrides(data, tmp_path / "validate", "torch"))
    tok = Tokenizer.from_pretrained(config.model.path)
    environment = check_environment(config.env.name, config.env.args)
    episodes = Episodes.from_config(
        config,
        tok,
        response_end_ids(read_model_spec(config.model.path), tok.eos_token_id),
        environment,
    )
    prompts = PromptSet.read(data, config, tok)
    policy = get_backend("torch").build_policy(config)
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0)
    found, samples = episodes.validate(policy, prompts, range(6), greedy, 6, seed=0)
    assert summary["accuracy"] == summary["pass_at_k"] == found / 6
    assert [r["responses"][0] for r in records] == [s["response"] for s in samples]
