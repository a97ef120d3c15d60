"""Tools a model can call, made from typed Python functions.

:meth:`Tool.from_function` reads a function's name, its docstring (the summary is the
description; a Google-style ``Args:`` section describes the parameters) and its type hints
(any type pydantic can validate: ``int``, ``float``, ``str``, ``bool``, ``Optional``,
``Literal``, ``list[...]``, ...; defaults make a parameter optional). It refuses, in one line
(:class:`ToolDefinitionError`), a parameter without a type hint, ``*args``/``**kwargs``,
positional-only parameters and types with no JSON schema. :attr:`Tool.schema` is the
``{"type": "function", "function": {...}}`` dict chat templates take as ``tools=``.

:meth:`Tool.call` never raises: what the model wrote is hostile input. Arguments that do
not validate, a function that raises, a result with no text form (:func:`result_text`) and
a call that runs past ``timeout_s`` each come back as a :class:`ToolOutcome` with
``error=True`` and a short message the model can read; long output is truncated to
``max_output_chars``. A result that is not text but a plain value (a number, ``None``, a
dict, a list, a dataclass or pydantic model) is sent as JSON, as MCP servers and TRL send
tool results. A function that knows its call failed (a snippet that raised) returns
a :class:`ToolOutcome` itself, ``error=True``: counted as a tool error, its text shown. Arguments are coerced as pydantic does in its lax mode (``"3"`` for an
``int`` is 3); unknown ones are refused.

The timeout: Python cannot stop a thread, so an in-process call runs in a daemon worker
thread and, past the deadline, the episode moves on with a timeout observation while the
runaway call keeps its thread (and whatever it holds) until it returns or the process
exits. Untrusted code belongs in a child process (the sandbox's ``python`` tool), not here.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
import pydantic_core

from strop.errors import ConfigError

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_OUTPUT_CHARS = 4000
_MAX_ERROR_CHARS = 500
_SECTION = re.compile(r"^([A-Z][A-Za-z ]*):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_NO_SCHEMA_KEYS = frozenset({"default", "enum", "const", "examples"})


class ToolDefinitionError(ConfigError):
    """A function cannot be a tool (one line: which function, which parameter, why)."""


@dataclass(frozen=True)
class ToolOutcome:
    """What a call gives the model: ``text``, and whether it is an error observation."""

    text: str
    error: bool = False


@dataclass(repr=False)
class Tool:
    """A callable tool: ``name``, ``description``, ``parameters`` (a JSON schema object),
    the function, the pydantic model its arguments are validated with, and the limits of a
    call. Build one with :meth:`from_function`."""

    function: Callable[..., Any]
    name: str
    description: str
    arguments_model: type[pydantic.BaseModel]
    parameters: dict[str, Any]
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> Tool:
        """A tool calling ``fn`` (plain or ``async def``); ``name``/``description`` default
        to the function's name and docstring summary. Raises :class:`ToolDefinitionError`."""
        if not callable(fn):
            raise ToolDefinitionError(f"a tool must be a function, got a {type(fn).__name__}")
        tool_name = name or getattr(fn, "__name__", "")
        if not re.fullmatch(r"[A-Za-z_][\w-]{0,63}", tool_name):
            raise ToolDefinitionError(f"tool name {tool_name!r} is not a valid function name")
        where = f"tool {tool_name!r}"
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            raise ToolDefinitionError(f"{where}: cannot read the signature of {fn!r}") from None
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except Exception as exc:
            raise ToolDefinitionError(
                f"{where}: cannot resolve its type hints ({type(exc).__name__}: {exc})"
            ) from None
        summary, documented = parse_docstring(inspect.getdoc(fn) or "")
        fields: dict[str, Any] = {}
        for param in signature.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                star = "*" if param.kind is param.VAR_POSITIONAL else "**"
                raise ToolDefinitionError(
                    f"{where}: {star}{param.name} is not supported; a tool takes named "
                    "parameters with type hints"
                )
            if param.kind is param.POSITIONAL_ONLY:
                raise ToolDefinitionError(
                    f"{where}: parameter {param.name!r} is positional-only; a tool is called "
                    "with named arguments"
                )
            if param.name not in hints:
                raise ToolDefinitionError(
                    f"{where}: parameter {param.name!r} has no type hint; annotate it "
                    f"(e.g. {param.name}: str) so the model knows what to pass"
                )
            if param.name.startswith("_"):
                raise ToolDefinitionError(
                    f"{where}: parameter {param.name!r} starts with '_'; rename it"
                )
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (
                hints[param.name],
                pydantic.Field(default, description=documented.get(param.name)),
            )
        try:
            model = pydantic.create_model(
                f"{tool_name}_arguments",
                __config__=pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=False),
                **fields,
            )
            schema = _without_titles(model.model_json_schema())
        except Exception as exc:
            text = " ".join(str(exc).split("\n")[0].split())
            raise ToolDefinitionError(
                f"{where}: a parameter's type has no JSON schema ({type(exc).__name__}: {text})"
            ) from None
        schema = {
            "type": "object",
            "properties": schema.pop("properties", {}),
            "required": schema.pop("required", []),
            **{key: value for key, value in schema.items() if key != "type"},
        }
        return cls(
            fn,
            tool_name,
            description if description is not None else summary,
            model,
            schema,
            timeout_s=timeout_s,
            max_output_chars=max_output_chars,
        )

    @property
    def schema(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def validate(self, arguments: Any) -> dict[str, Any] | str:
        """The call's keyword arguments, validated and coerced; else a short message."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                return f"the arguments are not valid JSON ({exc.msg} at character {exc.pos})"
            except RecursionError:
                return "the arguments are JSON nested too deeply to read"
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            return f"the arguments must be a JSON object, got {type(arguments).__name__}"
        try:
            parsed = self.arguments_model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            problems = []
            for err in exc.errors()[:5]:
                where = ".".join(str(part) for part in err["loc"]) or "arguments"
                problems.append(f"{where}: {err['msg']}")
            more = f" (and {exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
            return "; ".join(problems) + more
        return {key: getattr(parsed, key) for key in type(parsed).model_fields}

    def call(self, arguments: Any) -> ToolOutcome:
        """Run the tool on the model's ``arguments`` (a dict or a JSON string); never raises
        (see the module docstring)."""
        kwargs = self.validate(arguments)
        if isinstance(kwargs, str):
            return self._error(f"bad arguments for {self.name}: {kwargs}")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                result = self.function(**kwargs)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
                box["result"] = result
            except BaseException as exc:  # SystemExit, KeyboardInterrupt too: observations
                box["error"] = exc

        if self.timeout_s is None:
            run()
        else:
            worker = threading.Thread(target=run, name=f"strop-tool-{self.name}", daemon=True)
            worker.start()
            worker.join(self.timeout_s)
            if worker.is_alive():
                return self._error(
                    f"{self.name} did not finish within {self.timeout_s:g} s and was abandoned"
                )
        if "error" in box:
            exc = box["error"]
            text = " ".join(str(exc).split())
            said = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
            return self._error(f"{self.name} raised {said}")
        result = box.get("result")
        error = isinstance(result, ToolOutcome) and bool(result.error)
        if isinstance(result, ToolOutcome):
            result = result.text
        text = result_text(result)
        if text is None:
            if isinstance(result, bytes):
                return self._error(f"{self.name} returned bytes that are not UTF-8 text")
            kind = type(result).__name__
            return self._error(f"{self.name} returned a {kind}, which has no text or JSON form")
        return ToolOutcome(self._truncated(text, self.max_output_chars), error=error)

    async def acall(self, arguments: Any) -> ToolOutcome:
        """:meth:`call` in a worker thread, so an event loop keeps running meanwhile."""
        return await asyncio.to_thread(self.call, arguments)

    def _error(self, message: str) -> ToolOutcome:
        limit = min(self.max_output_chars, _MAX_ERROR_CHARS)
        return ToolOutcome(self._truncated(f"error: {message}", limit), error=True)

    @staticmethod
    def _truncated(text: str, limit: int) -> str:
        if len(text) <= limit:
            return text
        return f"{text[:limit]}\n[truncated: {len(text) - limit} more characters]"


def result_text(value: Any) -> str | None:
    """The text a tool's result is sent to the model as: text as it is, UTF-8 bytes decoded,
    any other value pydantic can make JSON (numbers, ``None``, dicts, lists, dataclasses,
    pydantic models, ...) as that JSON; None when it has no such form."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    try:
        return json.dumps(pydantic_core.to_jsonable_python(value), ensure_ascii=False)
    except (pydantic_core.PydanticSerializationError, TypeError, ValueError):
        return None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """``(summary, {parameter: description})`` of a Google-style docstring: the summary is
    the text before the first section (``Args:``, ``Returns:``, ...), joined into one line
    per paragraph; the descriptions come from ``Args:`` (``name (type): text``, continued on
    more-indented lines)."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    summary: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        header = _SECTION.match(line)
        if header and indent == 0:
            section, current, arg_indent = header.group(1).lower(), None, None
            continue
        if section is None:
            summary.append(stripped)
            continue
        if section not in ("args", "arguments", "parameters", "params") or not stripped:
            continue
        if arg_indent is None:
            arg_indent = indent
        match = _ARG_LINE.match(stripped)
        if indent <= arg_indent and match:
            current = match.group(1)
            params[current] = match.group(2).strip()
        elif current is not None:
            params[current] = f"{params[current]} {stripped}".strip()
    paragraphs = "\n".join(summary).strip().split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip()), params


def _without_titles(node: Any) -> Any:
    """A pydantic JSON schema without its ``title`` entries (they only repeat names)."""
    if isinstance(node, list):
        return [_without_titles(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _without_titles(sub) for name, sub in value.items()}
        elif key in _NO_SCHEMA_KEYS:
            out[key] = value
        else:
            out[key] = _without_titles(value)
    return out
