"""The built-in ``python`` environment: the sandboxed tool in a scripted episode; a snippet
that fails is a tool error the model sees, counted, never a crash."""

from __future__ import annotations

import json

import pytest

from strop.agents.environment import EnvironmentLoadError, load_environment
from strop.agents.rollout import RolloutLimits, run_episodes
from strop.agents.sandbox import SandboxLimits, SandboxUnavailableError, run_python
from strop.agents.tools import Tool, ToolOutcome
from tests.unit.test_agents_rollout import Scripted, tok  # noqa: F401

SMALL = SandboxLimits(wall_time_s=8, cpu_time_s=1, memory_mb=256, max_processes=8)


@pytest.fixture(scope="module", autouse=True)
def sandbox_available():
    try:
        run_python("pass", SMALL)
    except SandboxUnavailableError as e:  # a host without namespaces: the sandbox refuses
        pytest.skip(str(e))


def call(code: str) -> str:
    body = json.dumps({"name": "python", "arguments": {"code": code}})
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_python_episode_runs_the_snippet_and_scores_the_answer(tok):  # noqa: F811
    scripts = {
        "What is six times seven?": [call("print(6*7)"), "#### 42"],
        "What is one over zero?": [call("print(1/0)"), "#### 0"],
    }
    records = [
        {"question": "What is six times seven?", "answer": "42"},
        {"question": "What is one over zero?", "answer": "1"},
    ]
    limits = RolloutLimits(max_turns=4, max_new_tokens=64, max_episode_tokens=4096)
    outcomes = run_episodes(
        records, lambda: load_environment("python", limits=SMALL), tok, Scripted(tok, scripts),
        limits,
    )  # fmt: skip
    good, bad = outcomes
    assert good.error is None and good.rewards == {"correct": 1.0}
    assert good.info["tool_calls"] == 1 and good.info["tool_errors"] == 0
    (tool,) = [m for m in good.episode.messages if m["role"] == "tool"]
    assert tool == {"role": "tool", "name": "python", "content": "42"}
    assert bad.error is None and bad.rewards == {"correct": 0.0}
    assert bad.info["tool_calls"] == 1 and bad.info["tool_errors"] == 1
    (tool,) = [m for m in bad.episode.messages if m["role"] == "tool"]
    assert "ZeroDivisionError" in tool["content"] and "[error: exit status 1" in tool["content"]


def test_a_function_can_report_its_own_error_and_long_text_is_cut():
    def check(text: str) -> ToolOutcome:
        """Check a text."""
        return ToolOutcome(text * 100, error=text == "bad")

    tool = Tool.from_function(check, max_output_chars=50)
    ok, failed = tool.call({"text": "fine"}), tool.call({"text": "bad"})
    assert not ok.error and failed.error
    assert failed.text.startswith("badbad") and "[truncated: 250 more characters]" in failed.text


def test_sandbox_limits_come_as_a_mapping_from_env_args():
    """env.args={limits: {wall_time_s: 2}}: a mapping, as YAML gives it; a bad key is one line."""
    env = load_environment("python", limits={"wall_time_s": 2, "memory_mb": 256})
    assert env.tools["python"].timeout_s == 2 + 5
    with pytest.raises(EnvironmentLoadError, match="limits: unknown setting 'wall_time'"):
        load_environment("python", limits={"wall_time": 2})
