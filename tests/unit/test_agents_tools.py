"""Tools from typed functions (strop.agents.tools): the JSON schema a chat template gets, the
coercion and refusal of the model's arguments, and every hostile outcome of a call as an
error observation, never an exception or a hang."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Literal, Optional

import pytest

from strop.agents.tools import Tool, ToolDefinitionError, ToolOutcome, parse_docstring
from strop.errors import StropError


def search(
    query: str,
    limit: int = 5,
    scale: float = 1.0,
    exact: bool = False,
    lang: Optional[str] = None,  # noqa: UP045 (the typing spelling must work too)
    mode: Literal["fast", "deep"] = "fast",
    tags: list[str] | None = None,
) -> str:
    """Search the notes.

    Finds notes that match, best first.

    Args:
        query: what to look for.
        limit (int): the most results
            to return.
        scale: a weight.

    Returns:
        The matching notes, one a line.
    """
    return f"{query}|{limit}|{scale}|{exact}|{lang}|{mode}|{tags}"


def test_schema_from_type_hints_defaults_and_docstring():
    tool = Tool.from_function(search)
    assert tool.name == "search"
    assert tool.schema["type"] == "function"
    function = tool.schema["function"]
    assert function["description"] == "Search the notes.\n\nFinds notes that match, best first."
    params = function["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["query"]
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for."}
    assert props["limit"] == {
        "type": "integer",
        "default": 5,
        "description": "the most results to return.",
    }
    assert props["scale"]["type"] == "number"
    assert props["exact"] == {"type": "boolean", "default": False}
    assert props["lang"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert props["mode"] == {"type": "string", "enum": ["fast", "deep"], "default": "fast"}
    assert {"type": "array", "items": {"type": "string"}} in props["tags"]["anyOf"]
    assert "title" not in str(params)  # pydantic's titles only repeat the names


def test_docstring_sections_and_continuations():
    summary, params = parse_docstring(
        "One line.\n\nArgs:\n    a (int): first\n        more\n    b: second\nRaises:\n    X: no"
    )
    assert summary == "One line."
    assert params == {"a": "first more", "b": "second"}
    assert parse_docstring("") == ("", {})


def test_arguments_are_coerced_and_defaults_filled():
    tool = Tool.from_function(search)
    out = tool.call({"query": "x", "limit": "3", "exact": "true", "tags": ["a"]})
    assert out == ToolOutcome("x|3|1.0|True|None|fast|['a']", error=False)
    assert tool.call('{"query": "y"}').text == "y|5|1.0|False|None|fast|None"  # a JSON string


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({}, "query: Field required"),
        ({"query": "x", "limit": "many"}, "limit: Input should be a valid integer"),
        ({"query": "x", "mode": "slow"}, "mode: Input should be 'fast' or 'deep'"),
        ({"query": "x", "nope": 1}, "nope: Extra inputs are not permitted"),
        ('{"query": ', "not valid JSON"),
        ([1, 2], "must be a JSON object, got list"),
    ],
)
def test_bad_arguments_are_an_error_observation(arguments, says):
    out = Tool.from_function(search).call(arguments)
    assert out.error and out.text.startswith("error: bad arguments for search: ")
    assert says in out.text


def _untyped(x) -> str:
    return x


def _star(*values: int) -> str:
    return ""


def _kwargs(**options: int) -> str:
    return ""


def _positional(x: int, /) -> str:
    return ""


class _Opaque:
    pass


def _opaque(x: _Opaque) -> str:
    return ""


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (_untyped, "parameter 'x' has no type hint"),
        (_star, "*values is not supported"),
        (_kwargs, "**options is not supported"),
        (_positional, "'x' is positional-only"),
        (_opaque, "has no JSON schema"),
        (42, "a tool must be a function"),
    ],
)
def test_unsupported_signatures_are_refused_in_one_line(fn, says):
    with pytest.raises(ToolDefinitionError) as caught:
        Tool.from_function(fn)
    assert isinstance(caught.value, StropError)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def _raises(x: int) -> str:
    raise ValueError(f"bad {x}\nsecond line")


def _exits() -> str:
    raise SystemExit(3)


def _object() -> str:
    return object()  # type: ignore[return-value]


def _bad_bytes() -> str:
    return b"\xff\xfe"  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (_raises, "_raises raised ValueError: bad 1 second line"),
        (_exits, "_exits raised SystemExit: 3"),
        (_object, "_object returned a object, which has no text or JSON form"),
        (_bad_bytes, "_bad_bytes returned bytes that are not UTF-8 text"),
    ],
)
def test_hostile_outcomes_are_error_observations(fn, says):
    out = Tool.from_function(fn).call({"x": 1} if fn is _raises else {})
    assert out == ToolOutcome(f"error: {says}", error=True)


@dataclasses.dataclass
class _Point:
    x: int
    y: float


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (3, "3"),
        (2.5, "2.5"),
        (True, "true"),
        (None, "null"),
        ({"a": [1, "é"]}, '{"a": [1, "é"]}'),
        ((1, 2), "[1, 2]"),
        (b"abc", "abc"),
        (_Point(1, 0.5), '{"x": 1, "y": 0.5}'),
    ],
    ids=["int", "float", "bool", "none", "dict", "tuple", "bytes", "dataclass"],
)
def test_a_plain_value_a_tool_returns_is_sent_as_text(value, text):
    """As TRL and MCP servers send them: text as it is, plain values as JSON (before: the
    call ran, its state changed, and the model was told it failed)."""
    calls = []

    def count() -> str:
        calls.append(1)
        return value  # type: ignore[return-value]

    assert Tool.from_function(count).call({}) == ToolOutcome(text)
    assert calls == [1]


def test_huge_output_is_truncated():
    def shout(n: int) -> str:
        return "a" * n

    tool = Tool.from_function(shout, max_output_chars=100)
    out = tool.call({"n": 10_000})
    assert not out.error
    assert out.text == "a" * 100 + "\n[truncated: 9900 more characters]"
    assert tool.call({"n": 100}).text == "a" * 100


def test_a_call_past_the_timeout_returns_promptly():
    release = threading.Event()

    def stuck(x: int) -> str:
        release.wait(30)
        return "late"

    tool = Tool.from_function(stuck, timeout_s=0.2)
    try:
        started = time.monotonic()
        out = tool.call({"x": 1})
        took = time.monotonic() - started
    finally:
        release.set()  # let the abandoned thread end
    assert out == ToolOutcome("error: stuck did not finish within 0.2 s and was abandoned", True)
    assert took < 2


def test_async_tools_are_awaited():
    async def echo(text: str) -> str:
        return text.upper()

    assert Tool.from_function(echo).call({"text": "hi"}) == ToolOutcome("HI")
