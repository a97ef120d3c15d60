"""A chat record's parts, checked: its ``messages`` (system, user, assistant and tool turns;
an assistant turn's ``tool_calls`` in the OpenAI format, arguments read into objects) and
its ``tools`` (JSON-schema objects for the chat template's ``tools=``). Each mistake is a
:class:`_BadLine` whose message says what is wrong; :mod:`strop.data.sources` names the file
and line."""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class _BadLine(Exception):
    """A malformed line; the message says what is wrong with it."""


def _messages(record: dict[str, Any], name: str = "messages") -> tuple[dict[str, Any], ...]:
    if name not in record:
        raise _BadLine(f"missing field '{name}'")
    messages = record[name]
    if not isinstance(messages, list):
        raise _BadLine(f"field '{name}' must be a list, got {_kind(messages)}")
    if not messages:
        raise _BadLine(f"field '{name}' is empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _BadLine(f"{name}[{i}] must be an object, got {_kind(message)}")
        calls = message.get("tool_calls")
        if calls is not None and message.get("role") == "assistant":
            message = {"content": "", **{k: v for k, v in message.items() if v is not None}}
        for key in ("role", "content"):
            if key not in message:
                raise _BadLine(f"{name}[{i}] is missing field '{key}'")
            if not isinstance(message[key], str):
                raise _BadLine(f"{name}[{i}].{key} must be a string, got {_kind(message[key])}")
        if message["role"] not in ROLES:
            raise _BadLine(f"{name}[{i}].role is {message['role']!r}; expected one of {ROLES}")
        turn: dict[str, Any] = {"role": message["role"], "content": message["content"]}
        if calls is not None:
            turn["tool_calls"] = _tool_calls(calls, f"{name}[{i}]", message["role"])
        if message["role"] == "tool" and message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise _BadLine(f"{name}[{i}].name must be a string, got {_kind(message['name'])}")
            turn["name"] = message["name"]
        out.append(turn)
    if out[0]["role"] in ("assistant", "tool"):
        article = "an" if out[0]["role"] == "assistant" else "a"
        raise _BadLine(
            f"{name}[0] is {article} {out[0]['role']} turn; a chat starts with a system or "
            "user turn"
        )
    return tuple(out)


def _tool_calls(calls: Any, where: str, role: str) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls`` in the OpenAI format, arguments as a dict (a JSON
    string of an object is read into one, as chat templates render dicts)."""
    if role != "assistant":
        raise _BadLine(f"{where} is a {role} turn with tool_calls; only assistant turns call tools")
    if not isinstance(calls, list) or not calls:
        raise _BadLine(f"{where}.tool_calls must be a non-empty list, got {_kind(calls)}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _BadLine(f'{at} must be {{"type": "function", "function": {{"name": str, ...}}}}')
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise _BadLine(f"{at}.function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise _BadLine(f"{at}.function.arguments must be an object, got {_kind(arguments)}")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _tools(record: dict[str, Any]) -> tuple[dict[str, Any], ...] | None:
    """A chat record's ``tools`` (JSON-schema dicts for the template), None when absent."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise _BadLine(f"field 'tools' must be a list of objects, got {_kind(tools)}")
    return tuple(tools)


def _kind(value: Any) -> str:
    """A JSON type name for messages: object, array, string, number, boolean, null."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(
        type(value), "number" if isinstance(value, int | float) else type(value).__name__
    )
