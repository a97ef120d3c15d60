"""Environments (strop.agents.environment, tool_env, calculator): ToolEnv episodes with a
scripted assistant, the calculator's evaluator on hostile input, and load_environment for
every kind of reference and every bad one (each one line)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from strop.agents.calculator import (
    CalculationError,
    calculate,
    calculator_environment,
    correct,
    evaluate,
)
from strop.agents.environment import (
    Environment,
    EnvironmentLoadError,
    StepResult,
    call_maybe_async,
    load_environment,
    register_source,
)
from strop.agents.tool_env import ToolEnv
from strop.errors import ConfigError, DataError, StropError


def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _run(env, record, replies):
    """Play ``replies`` as the assistant's turns; the conversation and each step's result."""
    messages = asyncio.run(call_maybe_async(env.reset, record))
    results = []
    for reply in replies:
        messages.append({"role": "assistant", "content": reply})
        result = asyncio.run(call_maybe_async(env.step, messages))
        results.append(result)
        if result.done:
            break
        messages += result.messages
    return messages, results


def _scored(record, messages):
    return {"last": float(messages[-1]["content"] == record["answer"])}


def test_an_episode_with_a_call_a_bad_call_an_unknown_tool_and_an_answer():
    env = ToolEnv([add], score=_scored, system_prompt="Be brief.", max_turns=5)
    replies = [
        "Adding." + _call("add", a=2, b="3"),
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>' + _call("add", a="x", b=1),
        _call("mul", a=1, b=2),
        "5",
    ]
    messages, results = _run(env, {"question": "2+3?", "answer": "5"}, replies)
    assert messages[:2] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
    ]
    assert results[0].messages == [{"role": "tool", "name": "add", "content": "5"}]
    assert results[0].info == {"tool_calls": 1, "tool_errors": 0, "truncated": 0}
    bad_json, bad_args = results[1].messages
    assert bad_json["name"] == "error" and "not valid JSON" in bad_json["content"]
    assert bad_args["name"] == "add" and "a: Input should be a valid integer" in bad_args["content"]
    assert results[1].info == {"tool_calls": 2, "tool_errors": 2, "truncated": 0}
    assert "there is no tool named 'mul'; the tools are: add" in results[2].messages[0]["content"]
    assert results[2].info["tool_errors"] == 1
    assert results[3] == StepResult(
        None, {"last": 1.0}, {"tool_calls": 0, "tool_errors": 0, "truncated": 0}
    )
    assert all(r.rewards == {} for r in results[:3])


def test_max_turns_truncates_without_running_the_calls():
    ran = []

    def record_it(x: int) -> str:
        ran.append(x)
        return "ok"

    env = ToolEnv([record_it], score=lambda record, messages: {"r": 0.5}, max_turns=2)
    limited = ToolEnv([record_it], tool_timeout_s=0.5, max_output_chars=7).tools["record_it"]
    assert (limited.timeout_s, limited.max_output_chars) == (0.5, 7)
    _, results = _run(env, {"prompt": "go"}, [_call("record_it", x=1), _call("record_it", x=2)])
    assert ran == [1]
    assert results[-1] == StepResult(
        None, {"r": 0.5}, {"tool_calls": 1, "tool_errors": 0, "truncated": 1}
    )


def test_structured_tool_calls_and_chat_records():
    env = ToolEnv([add], tool_format="llama3_json")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "gold"}]
    messages = env.reset({"messages": chat})
    assert messages == chat[:1]
    messages.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
            ],
        }
    )
    result = asyncio.run(env.step(messages))
    assert result.messages == [{"role": "tool", "name": "add", "content": "3"}]
    assert env.tool_schemas[0]["function"]["name"] == "add"


def test_environments_made_per_episode_share_their_function_s_tool():
    """A ToolEnv is made per episode: a function's tool (its pydantic model, its schema) is
    built once per function and limits, not at every episode (64 a calculator iteration)."""
    first, second = calculator_environment(), calculator_environment()
    assert first.tools["calculate"] is second.tools["calculate"]
    assert ToolEnv([add]).tools["add"] is ToolEnv([add]).tools["add"]
    assert ToolEnv([add], tool_timeout_s=1.0).tools["add"].timeout_s == 1.0  # limits differ


def test_tool_env_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        ToolEnv([add, add])
    with pytest.raises(ConfigError, match="max_turns must be at least 1"):
        ToolEnv([add], max_turns=0)
    with pytest.raises(DataError, match="needs 'messages', 'prompt' or 'question'"):
        ToolEnv([add]).reset({"answer": "1"})
    with pytest.raises(DataError, match="end with the assistant's turn"):
        asyncio.run(ToolEnv([add]).step([{"role": "user", "content": "x"}]))


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("9**9**9", "too large"),
        ("2**100000", "too large"),
        ("10**200 * 10**200", "too large"),
        ("1e308 * 10", "too large"),
        ("__import__('os')", "Call is not allowed"),
        ("().__class__", "Attribute is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'a' * 3", "'a' is not a number"),
        ("True + 1", "True is not a number"),
        ("1 < 2", "Compare is not allowed"),
        ("1 +", "cannot parse"),
        ("1" * 10_000, "the limit is 500"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** (1/3)", "not real"),
        ("", "empty"),
    ],
)
def test_the_calculator_refuses_hostile_input(expression, says):
    with pytest.raises(CalculationError, match=says):
        evaluate(expression)
    out = calculator_environment().tools["calculate"].call({"expression": expression})
    assert out.error and out.text.startswith("error: calculate raised CalculationError: ")


@pytest.mark.parametrize(
    ("expression", "shown"),
    [
        ("(3 + 4) * 12", "84"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-2 ** 2", "-4"),
        ("2^10", "1024"),
        ("6 / 3", "2"),
        ("-" * 99 + "1", "-1"),
        ("2 ** 0.5", "1.41421356237"),
    ],
)
def test_the_calculator_computes(expression, shown):
    assert calculate(expression) == shown


def test_a_calculator_episode_is_scored_on_the_final_answer():
    env = load_environment("calculator", max_turns=3)
    record = {"question": "What is 12 * 7?", "answer": "Twelve sevens.\n#### 84"}
    messages, results = _run(
        env, record, [_call("calculate", expression="12*7"), "It is 84.\n#### 84"]
    )
    assert messages[0]["content"].startswith("Solve the problem")
    assert results[0].messages[0]["content"] == "84"
    assert results[-1].rewards == {"correct": 1.0}
    assert correct(record, [{"role": "assistant", "content": "#### 85"}]) == {"correct": 0.0}
    assert correct(record, [{"role": "assistant", "content": "no idea"}]) == {"correct": 0.0}
    assert correct({"question": "q"}, [{"role": "assistant", "content": "84"}]) == {"correct": 0.0}


FACTORY = """
class Counter:
    def __init__(self, start=0):
        self.start = start

    async def reset(self, record):
        return [{"role": "user", "content": str(self.start)}]

    def step(self, messages):
        return None


def make(**kwargs):
    return Counter(**kwargs)


def broken(**kwargs):
    raise RuntimeError("no GPU\\nat all")


def not_an_env(**kwargs):
    return {"reset": 1}


async def coroutine(**kwargs):
    return Counter()

VALUE = 3
"""


@pytest.fixture
def env_file(tmp_path, monkeypatch):
    (tmp_path / "strop_test_agent_envs.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "strop_test_agent_envs.py"
    sys.modules.pop("strop_test_agent_envs", None)


def test_load_environment_from_a_module_a_file_and_a_class(env_file):
    by_module = load_environment("strop_test_agent_envs:make", start=4)
    assert isinstance(by_module, Environment)
    assert asyncio.run(call_maybe_async(by_module.reset, {})) == [{"role": "user", "content": "4"}]
    by_file = load_environment(f"{env_file}:make")
    assert type(by_file).__name__ == "Counter"
    assert load_environment("strop_test_agent_envs:Counter", start=1).start == 1
    assert isinstance(load_environment("calculator"), ToolEnv)


def test_a_registered_source_resolves_its_references(env_file, monkeypatch):
    """``<source>:<name>`` goes to the source registered under that word (``verifiers`` is
    one, registered by strop.agents); ``package.module:factory`` is untouched by it."""
    import strop.agents.environment as environment

    asked = []

    def toy(reference, name):
        asked.append((reference, name))
        return lambda **kwargs: load_environment("strop_test_agent_envs:make", **kwargs)

    monkeypatch.setattr(environment, "SOURCES", dict(environment.SOURCES))
    register_source("toy", toy)
    assert sorted(environment.SOURCES) == ["toy", "verifiers"]
    env = load_environment(" toy: my_game ", start=3)
    assert asked == [("toy: my_game", "my_game")]
    assert asyncio.run(call_maybe_async(env.reset, {})) == [{"role": "user", "content": "3"}]
    assert type(load_environment("strop_test_agent_envs:make")).__name__ == "Counter"


@pytest.mark.parametrize(
    ("reference", "says"),
    [
        ("calculater", "unknown built-in environment; the built-in ones are calculator"),
        ("envs.py", "give the factory too: envs.py:FACTORY"),
        ("verifiers:wordle", "no module named 'wordle' on the Python path"),
        ("no_such_strop_module:make", "no module named 'no_such_strop_module'"),
        ("missing/envs.py:make", "missing/envs.py does not exist"),
        ("strop_test_agent_envs:mkae", "has no function 'mkae', did you mean 'make'?"),
        ("strop_test_agent_envs:VALUE", "'VALUE' in module strop_test_agent_envs is a int"),
        (
            "strop_test_agent_envs:broken",
            "strop_test_agent_envs.py:18: RuntimeError: no GPU at all",
        ),
        ("strop_test_agent_envs:not_an_env", "returned a dict, which has no reset or step method"),
        ("strop_test_agent_envs:coroutine", "coroutine is async; the factory must return"),
        ("a b:c", "is neither a module name nor a .py file"),
        ("calculator:", "expected a built-in name"),
    ],
)
def test_bad_references_are_one_line(env_file, reference, says):
    with pytest.raises(EnvironmentLoadError) as caught:
        load_environment(reference)
    message = str(caught.value)
    assert isinstance(caught.value, StropError)
    assert message.startswith(f"environment {reference!r}: ") and "\n" not in message
    assert says in message


def test_calls_past_max_tool_calls_per_turn_do_not_run():
    ran = []

    def record_it(x: int) -> str:
        ran.append(x)
        return "ok"

    env = ToolEnv([record_it], max_tool_calls_per_turn=8)
    _, (result,) = _run(
        env, {"prompt": "go"}, ["".join(_call("record_it", x=i) for i in range(300))]
    )
    assert ran == list(range(8))
    assert [m["content"] for m in result.messages[:8]] == ["ok"] * 8
    (refusal,) = result.messages[8:]
    assert refusal["name"] == "error" and "292 more tool calls were not run" in refusal["content"]
    assert result.info == {"tool_calls": 300, "tool_errors": 292, "truncated": 0}
    assert ToolEnv([record_it]).max_tool_calls_per_turn == 8  # the default
    with pytest.raises(ConfigError, match="max_tool_calls_per_turn must be at least 1"):
        ToolEnv([record_it], max_tool_calls_per_turn=0)


def test_an_unknown_tool_s_huge_name_is_cut_in_the_tool_message():
    env = ToolEnv([add])
    name = "x" * 200_000
    _, (result,) = _run(env, {"prompt": "go"}, [_call(name, a=1)])
    (reply,) = result.messages
    assert len(reply["name"]) <= 80 and reply["name"].startswith("xxx")
    assert len(reply["content"]) <= 500 and "there is no tool named" in reply["content"]


def test_a_trl_conversational_prompt_only_record_opens_an_episode():
    """TRL's prompt-only records in the conversational format: ``prompt`` is a chat."""
    env = ToolEnv([add], system_prompt="Be brief.")
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    assert asyncio.run(call_maybe_async(env.reset, {"prompt": chat, "answer": "5"})) == [
        {"role": "system", "content": "Be brief."},
        *chat,
    ]
