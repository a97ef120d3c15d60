"""Tool calls in the text a model generated, in the format its chat template taught it.

Three formats, named as vLLM names its tool parsers:

* ``hermes`` (alias ``qwen``; Qwen2.5, Qwen3, Hermes): each call is a JSON object in tags,
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, possibly several, after
  optional text (the message's content). The object is read as JSON from the opening tag, so
  a ``</tool_call>`` inside one of its strings (code that prints it) is part of the string;
  a call whose JSON does not end at a closing tag is read to the next one. A last
  ``<tool_call>`` whose closing tag is missing (generation stopped at it) is read to the end
  of the text.
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the message *is* a JSON object
  ``{"name": "f", "parameters": {...}}`` (``arguments`` is accepted too), optionally after
  ``<|python_tag|>``; several may be separated by ``;``. Text before ``<|python_tag|>`` is
  content; without the tag, a message that does not start with ``{`` has no call.
* ``mistral`` (Mistral 7B v0.3, Ministral, Mistral Small / Nemo): ``[TOOL_CALLS]``
  followed by a JSON list of calls ``[{"name": "f", "arguments": {...}, "id": "..."}]``
  (one object is read as a list of one); the newer ``[TOOL_CALLS]f[ARGS]{...}`` form
  (Mistral Small 3.2, Magistral; ``[CALL_ID]...`` allowed before ``[ARGS]``) is read too,
  one call per ``[TOOL_CALLS]``. Text before the first ``[TOOL_CALLS]`` is content.

:func:`parse_tool_calls` never raises: a call whose JSON is malformed, that has no
``name``, or whose arguments are not an object becomes a :class:`ToolCallError` in its
place, for the environment to answer with an error observation; so does JSON nested too
deeply for Python's decoder (``[`` 3,000 times).
:func:`detect_format` picks the format from a chat template's text.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from strop.errors import ConfigError

FORMATS = ("hermes", "llama3_json", "mistral")
_ALIASES = {
    "hermes": "hermes",
    "qwen": "hermes",
    "llama3_json": "llama3_json",
    "mistral": "mistral",
}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_DECODER = json.JSONDecoder()
_MAX_SHOWN = 60


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's ``name`` and its ``arguments`` (a dict)."""

    name: str
    arguments: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The call as a message's ``tool_calls`` entry (OpenAI / Hugging Face format)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallError:
    """A call that could not be read: why, in a line the model can read; ``name`` when the
    call had a readable one."""

    message: str
    name: str | None = None


@dataclass
class ParsedMessage:
    """An assistant message read from generated text: its ``content`` and, in the order
    the model wrote them, its ``calls`` (each a :class:`ToolCall` or a
    :class:`ToolCallError`)."""

    content: str
    calls: list[ToolCall | ToolCallError] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if isinstance(c, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [c for c in self.calls if isinstance(c, ToolCallError)]

    def as_message(self) -> dict[str, Any]:
        """The assistant message in the shared chat format (``tool_calls`` only if any)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        return message


def format_name(name: str) -> str:
    """The canonical format for ``name`` (``qwen`` is ``hermes``); ConfigError if unknown."""
    canonical = _ALIASES.get(name.strip().lower())
    if canonical is None:
        raise ConfigError(
            f"unknown tool-call format {name!r}; the formats are hermes (alias qwen), "
            "llama3_json and mistral"
        )
    return canonical


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template renders, or None if it renders none we know:
    ``hermes`` when it writes ``<tool_call>`` tags, ``mistral`` when it writes
    ``[TOOL_CALLS]``, ``llama3_json`` when it writes ``"parameters":`` objects or uses
    ``<|python_tag|>``."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if MISTRAL_CALLS in chat_template:
        return "mistral"
    if PYTHON_TAG in chat_template or re.search(r'"parameters"\s*:', chat_template):
        return "llama3_json"
    return None


def parse_tool_calls(text: str, format: str = "hermes") -> ParsedMessage:
    """Read ``text`` (an assistant's generated message, special tokens kept) in ``format``
    (see the module docstring). Never raises on what the model wrote."""
    parse = {"hermes": _parse_hermes, "llama3_json": _parse_llama3_json, "mistral": _parse_mistral}
    return parse[format_name(format)](text)


def _parse_hermes(text: str) -> ParsedMessage:
    outside: list[str] = []
    calls: list[ToolCall | ToolCallError] = []
    at = 0
    while (start := text.find(HERMES_OPEN, at)) >= 0:
        outside.append(text[at:start])
        body = start + len(HERMES_OPEN)
        call, at = _hermes_json(text, body)
        if call is None:  # not one JSON object up to a closing tag: the text up to the next
            close = text.find(HERMES_CLOSE, body)
            end = len(text) if close < 0 else close
            call, at = _read_call(text[body:end], ("arguments",)), end + len(HERMES_CLOSE)
        calls.append(call)
    outside.append(text[at:])
    content = "\n".join(part.strip() for part in outside if part.strip())
    return ParsedMessage(content, calls)


def _hermes_json(text: str, at: int) -> tuple[ToolCall | ToolCallError | None, int]:
    """The call whose JSON starts at ``at`` (after whitespace) and is followed by the
    closing tag or the end of the text, and where the text goes on; ``(None, at)`` if none."""
    start = len(text) - len(text[at:].lstrip())
    try:
        value, end = _DECODER.raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError):
        return None, at
    rest = len(text) - len(text[end:].lstrip())
    if rest == len(text):
        return _checked(value, ("arguments",)), rest
    if text.startswith(HERMES_CLOSE, rest):
        return _checked(value, ("arguments",)), rest + len(HERMES_CLOSE)
    return None, at


def _parse_llama3_json(text: str) -> ParsedMessage:
    content, tagged, body = "", False, text
    if PYTHON_TAG in text:
        content, _, body = text.partition(PYTHON_TAG)
        content, tagged = content.strip(), True
    body = body.strip()
    if not tagged and not body.startswith("{"):
        return ParsedMessage(text.strip())
    calls: list[ToolCall | ToolCallError] = []
    at = 0
    while at < len(body):
        try:
            value, end = _DECODER.raw_decode(body, at)
        except (json.JSONDecodeError, RecursionError) as exc:
            calls.append(ToolCallError(_bad_json(exc, body[at:])))
            break
        calls.append(_checked(value, ("parameters", "arguments")))
        at = end
        rest = body[at:].lstrip()
        if rest.startswith(";"):
            at = len(body) - len(rest) + 1
            while at < len(body) and body[at].isspace():
                at += 1
            continue
        if rest:  # text after the call(s): kept as content
            content = f"{content}\n{rest}".strip()
        break
    return ParsedMessage(content, calls)


def _parse_mistral(text: str) -> ParsedMessage:
    content, *segments = text.split(MISTRAL_CALLS)
    calls: list[ToolCall | ToolCallError] = []
    for segment in segments:
        found, rest = _mistral_calls(segment.strip())
        calls += found
        content = f"{content}\n{rest}"  # text after a call list is content
    return ParsedMessage(content.strip(), calls)


def _mistral_calls(body: str) -> tuple[list[ToolCall | ToolCallError], str]:
    """The calls after one ``[TOOL_CALLS]`` (``body``: the text up to the next), and the
    text after them."""
    name, args, raw = body.partition(MISTRAL_ARGS)
    if args and not name.startswith(("[", "{")):  # name[ARGS]{...}, not a JSON list
        name = name.partition(MISTRAL_CALL_ID)[0].strip()
        raw = raw.strip()
        try:
            arguments, end = _DECODER.raw_decode(raw)
        except (json.JSONDecodeError, RecursionError) as exc:
            return [ToolCallError(_bad_json(exc, raw), name or None)], ""
        return [_checked({"name": name, "arguments": arguments}, ("arguments",))], raw[end:]
    try:
        value, end = _DECODER.raw_decode(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return [ToolCallError(_bad_json(exc, body))], ""
    items = value if isinstance(value, list) else [value]
    return [_checked(item, ("arguments", "parameters")) for item in items], body[end:]


def _read_call(raw: str, keys: tuple[str, ...]) -> ToolCall | ToolCallError:
    body = raw.strip()
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        return ToolCallError(_bad_json(exc, body))
    return _checked(value, keys)


def _checked(value: Any, keys: tuple[str, ...]) -> ToolCall | ToolCallError:
    """A call from a decoded JSON value: an object with a string ``name`` and its arguments
    under the first of ``keys`` present (an object, or a JSON string holding one)."""
    if not isinstance(value, dict):
        return ToolCallError(
            f"a tool call must be a JSON object with a name, got {type(value).__name__}"
        )
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError('the tool call has no "name" (a non-empty string)')
    name = name.strip()
    key = next((k for k in keys if k in value), None)
    arguments = {} if key is None else value[key]
    if isinstance(arguments, str):  # stringified arguments (OpenAI style)
        with contextlib.suppress(json.JSONDecodeError, RecursionError):
            arguments = json.loads(arguments) if arguments.strip() else {}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(
            f'the "{key}" of the call to {name} must be a JSON object, got '
            f"{type(arguments).__name__}",
            name,
        )
    return ToolCall(name, arguments)


def _bad_json(exc: json.JSONDecodeError | RecursionError, body: str) -> str:
    shown = body if len(body) <= _MAX_SHOWN else body[:_MAX_SHOWN] + "..."
    if isinstance(exc, RecursionError):
        return f"the tool call's JSON is nested too deeply to read: {shown!r}"
    return f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}): {shown!r}"
