"""`strop ppo` / `strop eval` on a Parquet file read by data.prompt_key / data.answer_key: a
missing column or a bad row is one line naming the file (and row), exit 2, before any model
is built; `strop eval` scores MATH records against their \\boxed{} gold."""

from __future__ import annotations

import json

import datasets
import pytest

from strop import rewards
from strop.commands.evaluation import run_eval
from strop.config import load_config
from strop.io.tiny import make_tiny_checkpoint

MATH = [
    {"problem": "What is 3 + 4?", "solution": "3 + 4 = \\boxed{7}", "level": 1},
    {"problem": "What is 1 + 1?", "solution": "It is $\\boxed{\\frac{4}{2}}$.", "level": 2},
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tables")
    make_tiny_checkpoint(root / "model", ["What is 3 + 4? It is seven. 0 1 2 3 4 5 6 7 8 9 ####"])
    datasets.disable_progress_bars()
    datasets.Dataset.from_list(MATH).to_parquet(str(root / "math.parquet"))
    bad = [MATH[0], {"problem": None, "solution": "\\boxed{1}", "level": 3}]
    datasets.Dataset.from_list(bad).to_parquet(str(root / "bad.parquet"))
    return root


@pytest.mark.parametrize(
    ("command", "recipe", "path_key", "mesh"),
    [
        ("ppo", "ppo-lora-tiny", "data.train_path", "mesh.tensor=-1"),
        ("eval", "tiny", "eval.path", "mesh.data=-1"),
    ],
)
@pytest.mark.parametrize(
    ("file", "keys", "error"),
    [
        ("math.parquet", "data.prompt_key=question", ": no column 'question' (data.prompt_key); "
         "its columns are problem, solution, level"),
        ("bad.parquet", "data.prompt_key=problem", ":2: field 'problem' must be a string, got "
         "null; fix the row, or set data.skip_bad_lines=true to skip bad rows"),
    ],
    ids=["missing-column", "null-in-row-2"],
)  # fmt: skip
def test_cli_refuses_a_bad_table_in_one_line_before_any_model_loads(
    inputs, tmp_path, capsys, no_model_builds, command, recipe, path_key, mesh, file, keys, error
):
    from strop.cli import main

    data = inputs / file
    args = [command, recipe, f"model.path={inputs / 'model'}", f"{path_key}={data}", keys,
            "data.answer_key=solution", "ppo.reward=math", "eval.reward=math",
            f"run_dir={tmp_path / 'run'}", "mesh.fsdp=1", mesh, "ppo.validate_every=0"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"error: {data}{error}"], lines


def test_eval_scores_math_records_against_their_boxed_gold(inputs, tmp_path, monkeypatch):
    from strop.rewards import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    seen: list[str] = []

    def probe(prompts, completions, answer, **columns):
        seen.extend(answer)
        return [0.0] * len(completions)

    rewards.register("gold_probe", replace=True, gold=rewards.get("math").gold)(probe)
    config = load_config(
        "tiny",
        [f"model.path={inputs / 'model'}", f"eval.path={inputs / 'math.parquet'}",
         "data.prompt_key=problem", "data.answer_key=solution", f"run_dir={tmp_path}",
         "eval.reward=gold_probe", "generation.max_new_tokens=2", "eval.batch_size=2",
         "mesh.fsdp=1", "mesh.data=-1"],
    )  # fmt: skip
    result = run_eval(config)
    assert seen == ["7", "\\frac{4}{2}"] and result.examples == 2
    results = [json.loads(x) for x in (tmp_path / "eval" / "results.jsonl").read_text().split("\n")
               if x]  # fmt: skip
    assert [r["source"] for r in results] == [f"{inputs / 'math.parquet'}:{i}" for i in (1, 2)]
    assert results[0]["prompt"] == "Question: What is 3 + 4?\nAnswer:"
