"""`strop ppo` / `strop eval` on records with no gold answer for the reward: exit 2 with one
line naming file:line and the reward, before any model is built; eval scores against the
extracted gold, not the whole completion."""

from __future__ import annotations

import json

import pytest

from strop import rewards
from strop.commands.evaluation import run_eval
from strop.config import load_config
from strop.io.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gold")
    make_tiny_checkpoint(root / "model", ["What is 3 + 4? It is seven. 0 1 2 3 4 5 6 7 8 9 ####"])
    records = [
        {"prompt": "What is 3 + 4?", "completion": " 3 + 4 = 7\n#### 7"},
        {"prompt": "What is 1 + 1?", "completion": " 1 + 1 = 2\n#### 2"},
        {"prompt": "What is 2 + 5?", "completion": " It is seven."},  # no gold
        {"prompt": "What is 2 + 2?", "completion": " 2 + 2 = 4\n#### 4"},
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "good.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records if "####" in r["completion"])
    )
    return root


@pytest.fixture
def own_registry(monkeypatch):
    """Rewards registered by a test stay in it (other tests list the built-in names)."""
    from strop.rewards import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))


@pytest.mark.parametrize(
    ("command", "recipe", "path_key", "reward_key", "mesh"),
    [
        ("ppo", "ppo-lora-tiny", "data.train_path", "ppo.reward", "mesh.tensor=-1"),
        ("eval", "tiny", "eval.path", "eval.reward", "mesh.data=-1"),
    ],
)
@pytest.mark.parametrize("reward", ["gsm8k", "math"])
def test_cli_refuses_records_without_gold_before_any_model_loads(
    inputs, tmp_path, capsys, no_model_builds, command, recipe, path_key, reward_key, mesh, reward
):
    from strop.cli import main

    data = inputs / "data.jsonl"
    args = [command, recipe, f"model.path={inputs / 'model'}", f"{path_key}={data}",
            f"{reward_key}={reward}", f"run_dir={tmp_path / 'run'}", "mesh.fsdp=1", mesh,
            "ppo.validate_every=0", "data.format=auto"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {data}:3: no gold answer for reward '{reward}'"), lines
    assert f"{reward_key}=format" in lines[0]


def test_eval_scores_against_the_extracted_gold(inputs, tmp_path, own_registry):
    seen: list[str] = []

    def probe(prompts, completions, answer, **columns):
        seen.extend(answer)
        return [0.0] * len(completions)

    rewards.register("gold_probe", replace=True, gold=rewards.get("gsm8k").gold)(probe)
    config = load_config(
        "tiny",
        [f"model.path={inputs / 'model'}", f"eval.path={inputs / 'good.jsonl'}",
         f"run_dir={tmp_path}", "eval.reward=gold_probe", "generation.max_new_tokens=2",
         "eval.batch_size=4", "mesh.fsdp=1", "mesh.data=-1"],
    )  # fmt: skip
    run_eval(config)
    assert seen == ["7", "2", "4"]  # not " 3 + 4 = 7\n#### 7"
    results = [
        json.loads(x) for x in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()
    ]
    assert [r["gold"] for r in results] == ["7", "2", "4"]
