"""`strop ppo env.name=verifiers:<module>`: a verifiers 0.4 tool-use taskset (written with
verifiers' own classes, tests/verifiers_calc.py) trains for 2 iterations on the shipped
tiny-calc model (torch, GRPO): its tool is called, its rewards are logged as reward parts,
and a reference to a module that is not there is one line (exit 2) before any model loads."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verifiers.v1", reason="the verifiers extra: pip install 'strop[verifiers]'")

from strop.agents.calculator import SYSTEM_PROMPT
from strop.agents.calculator_tasks import calc_splits
from strop.assets import tiny_calc_path
from strop.config import load_config
from strop.metrics.sinks import read_metrics
from strop.rl.ppo import run_ppo

ENV = "env.name=verifiers:tests.verifiers_calc"


def records(problems):
    return "".join(
        json.dumps({"prompt": p.question, "answer": str(p.value), "system_prompt": SYSTEM_PROMPT})
        + "\n"
        for p in problems
    )


def test_a_verifiers_taskset_trains_two_iterations(tmp_path):
    train, _ = calc_splits(0, 8, 0)
    (tmp_path / "train.jsonl").write_text(records([p for p in train if p.careful][:2]))
    config = load_config(
        "ppo-lora-tiny",
        [
            f"model.path={tiny_calc_path()}", f"data.train_path={tmp_path / 'train.jsonl'}",
            f"run_dir={tmp_path / 'run'}", "backend=torch", "mesh.fsdp=1", "mesh.tensor=-1",
            ENV, "data.prompt_key=prompt", "ppo.reward=none", "env.max_episode_tokens=256", "env.max_turns=3",
            "generation.max_new_tokens=32", "ppo.advantage_estimator=grpo",
            "ppo.kl_in_reward=false", "ppo.steps=2", "ppo.prompts_per_step=2",
            "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=4",
            "ppo.validate_every=0", "checkpoint.every_steps=100",
        ],
    )  # fmt: skip
    run_ppo(config)
    written = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in written] == [1, 2]
    for record in written:
        assert {"reward/correct", "reward/used_tool", "env/tool_calls", "train/reward"} <= set(
            record
        )
        assert record["env/errors"] == 0.0
    # tiny-calc calls `calculate` on careful questions: the tool ran and was rewarded.
    assert max(r["env/tool_calls"] for r in written) > 0
    assert max(r["reward/used_tool"] for r in written) == pytest.approx(0.5)


def test_a_missing_verifiers_module_is_one_line_before_any_model_loads(
    tmp_path, capsys, no_model_builds
):
    from strop.cli import main

    (tmp_path / "train.jsonl").write_text(records(calc_splits(0, 2, 0)[0]))
    with pytest.raises(SystemExit) as info:
        main([
            "ppo", "ppo-lora-tiny", f"model.path={tiny_calc_path()}",
            f"data.train_path={tmp_path / 'train.jsonl'}", f"run_dir={tmp_path / 'run'}",
            "backend=torch", "env.name=verifiers:no_such_verifiers_env", "ppo.reward=none",
            "ppo.validate_every=0",
        ])  # fmt: skip
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "no module named 'no_such_verifiers_env'" in lines[0], lines
