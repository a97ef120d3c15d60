"""The ``env`` config section (multi-turn episodes in ``strop ppo`` and ``strop eval``): its
defaults, what it refuses in one line when it loads, the environment reference imported and
its factory built at preflight (``check_environment``; `strop eval`'s too), and the
context-length check against ``env.max_episode_tokens``."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

import strop
from strop.config import Config, dump_config, load_config
from strop.errors import ConfigError
from strop.io.model_spec import check_context_length, read_model_spec
from strop.run.preflight import check_environment

TINY_MATH = str(Path(strop.__file__).parent / "assets" / "tiny-math")  # 256 positions

ENV_FILE = """
class TwoTurns:
    def reset(self, record):
        return [{"role": "user", "content": record["question"]}]

    def step(self, messages):
        return None


def make(**kwargs):
    return TwoTurns()


class Broken:
    def reset(self, record):
        return []
"""


def test_defaults_keep_single_turn_runs_as_they_were() -> None:
    config = Config()
    env = config.env
    assert (env.name, env.args, env.enabled) == ("none", {}, False)
    assert (env.max_turns, env.max_episode_tokens) == (4, 1024)
    assert (env.step_timeout_s, env.max_error_fraction) == (60.0, 0.5)
    assert env.max_tool_calls_per_turn == 8
    assert (env.tool_timeout_s, env.tool_workers) == (None, None)  # the tools', one per episode
    assert config.ppo.reward == "gsm8k"


def test_an_environment_scores_the_episodes_and_the_config_round_trips(tmp_path) -> None:
    config = load_config(None, ["env.name=calculator", "env.args={max_turns: 2}"])
    assert config.env.enabled and config.env.args == {"max_turns": 2}
    assert config.ppo.reward == "none"  # unset: the environment's reward parts score
    again = tmp_path / "config.yaml"  # what a run writes, and `strop export` reads back
    again.write_text(dump_config(config))
    assert load_config(again).model_dump() == config.model_dump()
    assert yaml.safe_load(dump_config(config))["env"]["name"] == "calculator"
    explicit = load_config(None, ["env.name=calculator", "ppo.reward=none"])
    assert explicit.ppo.reward == "none"
    served = load_config(None, ["env.name=calculator", "generation.engine=vllm"])
    assert served.generation.engine == "vllm"  # episodes on vLLM (tests/vllm_engine)


def test_weighted_trainer_rewards_go_beside_the_environment_s_parts(tmp_path) -> None:
    """As TRL sums reward_funcs with the environment's reward: ppo.reward as weighted terms
    goes with env.name (a single named reward, as the shipped recipes set for single-turn
    runs, is still refused: it would silently add to the environment's parts)."""
    terms = "ppo.reward=[{reward: format, weight: 0.1}, {reward: gsm8k, weight: 0}]"
    config = load_config(None, ["env.name=calculator", terms])
    assert [(t.reward, t.weight) for t in config.ppo.reward] == [("format", 0.1), ("gsm8k", 0.0)]
    again = tmp_path / "config.yaml"
    again.write_text(dump_config(config))
    assert load_config(again).model_dump() == config.model_dump()


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            ["env.name=calculator", "ppo.reward=gsm8k"],
            "set ppo.reward=none, or add a reward of each episode's final answer to its parts "
            "as weighted terms: ppo.reward=[{reward: gsm8k, weight: 0.1}]",
        ),
        (["ppo.reward=none"], "ppo.reward=none leaves nothing to score"),
        (["env.name=calculator", "eval.reward=math"], "leave eval.reward unset"),
        (["env.name=calculator", "ppo.overlong=penalty"], "use ppo.overlong=mask or keep"),
        (["env.max_turns=0"], "env.max_turns: Input should be greater than 0"),
        (["env.max_episode_tokens=-4"], "env.max_episode_tokens: Input should be greater than 0"),
        (["env.step_timeout_s=nan"], "env.step_timeout_s: Input should be a finite number"),
        (["env.max_error_fraction=1.5"], "env.max_error_fraction: Input should be less than"),
        (
            ["env.max_tool_calls_per_turn=0"],
            "env.max_tool_calls_per_turn: Input should be greater than 0",
        ),
        (["env.tool_workers=0"], "env.tool_workers: Input should be greater than 0"),
        (["env.tool_timeout_s=-1"], "env.tool_timeout_s: Input should be greater than 0"),
        (["env.args=3"], "env.args: Input should be a valid dictionary"),
        (["env.nmae=calculator"], "did you mean 'env.name'?"),
    ],
)
def test_bad_env_settings_are_one_line(overrides, said) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message and said in message, message


@pytest.mark.parametrize(
    ("name", "args", "said"),
    [
        ("calculater", {}, "unknown built-in environment; the built-in ones are calculator"),
        ("nothere.py:make", {}, "nothere.py does not exist"),
        ("envs.py:mak", {}, "did you mean 'make'?"),
        ("no_such_pkg.mod:make", {}, "no module named 'no_such_pkg'"),
        ("verifiers:wordle", {}, "no module named 'wordle' on the Python path"),
        ("calculator", {"turns": 2}, "calculator_environment(...) failed: "),
        ("envs.py:Broken", {}, "which has no step method"),
    ],
)
def test_an_environment_that_cannot_be_built_is_one_line(tmp_path, monkeypatch, name, args, said):
    (tmp_path / "envs.py").write_text(ENV_FILE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        check_environment(name, args)
    message = str(info.value)
    assert message.startswith(f"env.name: environment {name!r}: ") and "\n" not in message
    assert said in message, message
    check_environment("envs.py:make", {"level": 3})  # the factory takes any keywords
    check_environment("calculator", {"max_turns": 2})


def test_preflight_warns_when_the_python_sandbox_can_read_the_gold_answers(caplog) -> None:
    # the sandbox's snippets run as a fresh uid (as root): they read what others may read. A
    # data file others can reach and read is a warning, not an error; a private one is not
    # (as another user than root, the snippets run as that user: always a warning)
    top = Path(tempfile.mkdtemp(prefix="strop-test-golds-"))  # under /tmp, which all enter
    try:
        data = top / "train.jsonl"
        data.write_text('{"question": "2+2", "answer": "4"}\n')
        seen = {}
        for case, (top_mode, file_mode) in {
            "readable": (0o755, 0o644), "private file": (0o755, 0o600),
            "private directory": (0o700, 0o644),
        }.items():  # fmt: skip
            top.chmod(top_mode)
            data.chmod(file_mode)
            for name in ("python", "calculator"):
                caplog.clear()
                check_environment(name, {}, (str(data), None))
                seen[case, name] = [r.getMessage() for r in caplog.records]
    finally:
        shutil.rmtree(top)
    (said,) = seen["readable", "python"]
    assert said.startswith(f"{data} is readable by the python tool's sandboxed snippets")
    assert "gold answers" in said and "\n" not in said
    root = os.getuid() == 0
    assert (
        bool(seen["private file", "python"])
        is bool(seen["private directory", "python"])
        is not root
    )
    assert not any(seen[case, "calculator"] for case in ("readable", "private file"))


def test_context_length_is_checked_against_the_episode_budget() -> None:
    TINY_MATH_SPEC = (read_model_spec(TINY_MATH), TINY_MATH)
    check = {"max_length": 512, "max_new_tokens": 300}  # one turn; an episode holds several
    with pytest.raises(ConfigError, match=r"generation\.max_new_tokens=300 leaves no room"):
        check_context_length(*TINY_MATH_SPEC, samples=True, **check)
    check_context_length(*TINY_MATH_SPEC, samples=True, **check, max_episode_tokens=256)
    check_context_length(
        *TINY_MATH_SPEC, samples=True, **check, longest_prompt=60, max_episode_tokens=256
    )
    with pytest.raises(ConfigError) as info:
        check_context_length(*TINY_MATH_SPEC, samples=True, **check, max_episode_tokens=257)
    assert str(info.value).startswith("env.max_episode_tokens=257 is more than the model's ")
    assert "lower env.max_episode_tokens to at most 256" in str(info.value)


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (("env.name=calculater",), "error: env.name: environment 'calculater': unknown built-in"),
        (("env.name=nothere.py:make",), "nothere.py does not exist"),
        (("env.name=calculator", "env.args={turns: 2}"), "calculator_environment(...) failed: "),
        (("env.name=calculator", "eval.reward=my.py:score"), "leave eval.reward unset"),
    ],
    ids=["unknown-built-in", "missing-file", "bad-args", "eval-reward"],
)
def test_strop_eval_with_a_bad_environment_is_one_line_before_anything_loads(
    tmp_path, monkeypatch, capsys, no_model_builds, extra, said
) -> None:
    from strop.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "val.jsonl").write_text('{"question": "What is 2 + 2?", "answer": "4"}\n')
    args = ["eval", "tiny", f"model.path={TINY_MATH}", "eval.path=val.jsonl", "run_dir=run"]
    with pytest.raises(SystemExit) as info:
        main([*args, *extra])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and said in lines[0], lines
