"""An environment whose turns are tool calls: :class:`ToolEnv`.

``reset(record)`` gives the system prompt (when set) and the record's prompt: its
``messages`` or a ``prompt`` that is a chat (TRL's conversational prompt-only records; a
last assistant turn, the reference answer, is dropped), else its ``prompt`` or
``question`` text as one user turn.

``step(messages)`` reads the last message, the assistant's: its ``tool_calls`` when the
caller parsed them already, else the calls in its ``content`` (:mod:`strop.agents.tool_calls`,
in the env's ``tool_format``). Then:

* no call (and nothing that tried to be one): the episode ends; ``score(record, messages)``
  gives the reward parts of the final answer;
* calls, on the assistant's ``max_turns``-th turn: the episode ends unrun, ``truncated``
  in ``info``, and the answer is scored as it stands (usually 0: there is none);
* else the first ``max_tool_calls_per_turn`` calls run, one after another
  (:meth:`~strop.agents.tools.Tool.call`: never raises, bounded in time and output), and
  one ``{"role": "tool", "name", "content"}`` message per call comes back, in the order of
  the calls; the calls past that limit do not run and are answered with one error message.
  A call that could not be read and a call to an unknown tool are answered with an error
  message of their own (a name that is no tool's shown cut to ``MAX_NAME_CHARS``).

Deadlines: each call has its own, counted from when it starts (``call_timeout_s``: the run's
``env.tool_timeout_s``; else its tool's ``timeout_s``); a turn's calls together have
``turn_timeout_s`` (a run sets it just under ``env.step_timeout_s``, so that slow calls end
as tool errors, never as a step past its deadline). A call past either deadline is answered
with an error message, the calls after the turn's time ran out do not run (one error
message), and all are counted in ``tool_errors``.

``info`` counts this step's ``tool_calls`` (every call the model attempted), ``tool_errors``
(those answered with an error) and ``truncated`` (1 when max_turns cut the episode).
An instance runs one episode at a time (``reset`` remembers the record).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from strop.agents.environment import Message, StepResult
from strop.agents.tool_calls import ToolCall, ToolCallError, format_name, parse_tool_calls
from strop.agents.tools import DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_TIMEOUT_S, Tool, ToolOutcome
from strop.errors import ConfigError, DataError

Score = Callable[[Mapping[str, Any], list[Message]], Mapping[str, float]]
ERROR_NAME = "error"  # the tool message's name when a call names no tool we could read
DEFAULT_MAX_TOOL_CALLS_PER_TURN = 8
MAX_NAME_CHARS = 64  # the longest tool name (Tool.from_function): longer ones are cut
STEP_RESERVE_S = 1.0  # what a step keeps of its deadline after its calls (at most 10% of it)

_tool_of = lru_cache(maxsize=256)(Tool.from_function)
"""A function's :class:`~strop.agents.tools.Tool`, built once per function and limits: an
environment is made per episode, and building a tool (its pydantic model and JSON schema)
took more time than the calculator episode's tool calls. Tools are never changed once
built, so environments share them."""


class ToolEnv:
    """An :class:`~strop.agents.environment.Environment` of tools (see the module docstring).

    Args:
      tools: :class:`~strop.agents.tools.Tool` s, or typed functions made into tools.
      score: ``score(record, messages) -> {part: value}`` for the final answer; None gives
        no reward.
      system_prompt: the first message of every episode, when set.
      max_turns: the most assistant turns in an episode (>= 1).
      tool_format: how calls are written in generated text: ``hermes`` (``qwen``),
        ``llama3_json`` or ``mistral`` (:mod:`strop.agents.tool_calls`).
      tool_timeout_s, max_output_chars: the limits of a call to a tool made here from a
        function (a :class:`~strop.agents.tools.Tool` given keeps its own).
      max_tool_calls_per_turn: the most calls of one assistant turn that run (>= 1).
      turn_timeout_s: the most seconds one turn's calls take together; None: no bound.

    ``call_timeout_s`` set after construction (:func:`with_run_limits` sets the run's)
    is the deadline of every call, the tools' own replaced.
    """

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any]],
        *,
        score: Score | None = None,
        system_prompt: str | None = None,
        max_turns: int = 4,
        tool_format: str = "hermes",
        tool_timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN,
        turn_timeout_s: float | None = None,
    ) -> None:
        if max_turns < 1:
            raise ConfigError(f"max_turns must be at least 1, got {max_turns}")
        if max_tool_calls_per_turn < 1:
            raise ConfigError(
                f"max_tool_calls_per_turn must be at least 1, got {max_tool_calls_per_turn}"
            )
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.turn_timeout_s = turn_timeout_s
        self.call_timeout_s: float | None = None  # the run's deadline of every call
        self.tools: dict[str, Tool] = {}
        for item in tools:
            tool = (
                item
                if isinstance(item, Tool)
                else _tool_of(item, timeout_s=tool_timeout_s, max_output_chars=max_output_chars)
            )
            if tool.name in self.tools:
                raise ConfigError(f"two tools are named {tool.name!r}; tool names must differ")
            self.tools[tool.name] = tool
        self.score = score
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.tool_format = format_name(tool_format)
        self.record: Mapping[str, Any] = {}

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools as a chat template's ``tools=`` takes them."""
        return [tool.schema for tool in self.tools.values()]

    def reset(self, record: Mapping[str, Any]) -> list[Message]:
        self.record = record
        start: list[Message] = []
        if self.system_prompt is not None:
            start.append({"role": "system", "content": self.system_prompt})
        return start + prompt_messages(record)

    async def step(self, messages: list[Message]) -> StepResult:
        if not messages or messages[-1].get("role") != "assistant":
            raise DataError("ToolEnv.step needs the conversation to end with the assistant's turn")
        calls = self.calls_of(messages[-1])
        turns = sum(1 for m in messages if m.get("role") == "assistant")
        info = {"tool_calls": len(calls), "tool_errors": 0, "truncated": 0}
        if not calls:
            return StepResult(None, self._scored(messages), info)
        if turns >= self.max_turns:
            info["truncated"] = 1
            return StepResult(None, self._scored(messages), info)
        replies = []
        turn = self.turn_timeout_s
        ends = None if turn is None else time.monotonic() + turn
        running = calls[: self.max_tool_calls_per_turn]
        for k, call in enumerate(running):
            left = None if ends is None else ends - time.monotonic()
            if left is not None and left <= 0:
                replies.append(
                    _not_run(len(running) - k, f"this turn's {turn:g} s of tool time ran out")
                )
                info["tool_errors"] += len(running) - k
                break
            name, outcome = await self._answer(call, left)
            info["tool_errors"] += outcome.error
            replies.append({"role": "tool", "name": name, "content": outcome.text})
        skipped = len(calls) - self.max_tool_calls_per_turn
        if skipped > 0:
            info["tool_errors"] += skipped
            cap = self.max_tool_calls_per_turn
            replies.append(_not_run(skipped, f"at most {cap} calls of one turn run"))
        return StepResult(replies, {}, info)

    def calls_of(self, message: Message) -> list[ToolCall | ToolCallError]:
        """The calls of an assistant message: its ``tool_calls`` if present, else those
        written in its content."""
        if message.get("tool_calls"):
            return [_structured(entry) for entry in message["tool_calls"]]
        return parse_tool_calls(str(message.get("content") or ""), self.tool_format).calls

    async def _answer(
        self, call: ToolCall | ToolCallError, left_s: float | None
    ) -> tuple[str, ToolOutcome]:
        """The call's tool message name and outcome; past ``left_s`` (the turn's time left) an
        error outcome, the call abandoned (its thread finishes, or times out, on its own)."""
        if isinstance(call, ToolCallError):
            name = shown_name(call.name) if call.name else ERROR_NAME
            return name, ToolOutcome(f"error: {call.message}", error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            said = shown_name(call.name)
            text = f"error: there is no tool named {said!r}; the tools are: {known}"
            return said, ToolOutcome(text[:500], error=True)
        if self.call_timeout_s is not None:
            tool = dataclasses.replace(tool, timeout_s=self.call_timeout_s)
        try:
            return call.name, await asyncio.wait_for(tool.acall(call.arguments), left_s)
        except TimeoutError:
            text = (
                f"error: {call.name} did not finish within the {left_s:.2g} s left of this "
                f"turn's {self.turn_timeout_s:g} s of tool time and was abandoned"
            )
            return call.name, ToolOutcome(text, error=True)

    def _scored(self, messages: list[Message]) -> dict[str, float]:
        if self.score is None:
            return {}
        return {name: float(value) for name, value in self.score(self.record, messages).items()}


def with_run_limits(
    factory: Callable[[], Any],
    *,
    max_tool_calls_per_turn: int,
    step_timeout_s: float | None = None,
    tool_timeout_s: float | None = None,
) -> Callable[[], Any]:
    """``factory`` whose :class:`ToolEnv` environments take the run's limits: its cap on
    calls per turn (``env.max_tool_calls_per_turn``), the deadline of each call
    (``env.tool_timeout_s``; None: the tools' own) and a turn's tool time, the step's
    deadline (``env.step_timeout_s``) less what the step keeps for itself
    (:data:`STEP_RESERVE_S`, at most a tenth of it). An environment of another kind is
    returned as made."""

    def environment() -> Any:
        env = factory()
        if isinstance(env, ToolEnv):
            env.max_tool_calls_per_turn = max_tool_calls_per_turn
            if step_timeout_s is not None:
                env.turn_timeout_s = step_timeout_s - min(STEP_RESERVE_S, step_timeout_s / 10)
            if tool_timeout_s is not None:
                env.call_timeout_s = tool_timeout_s
        return env

    environment.__name__ = getattr(factory, "__name__", type(factory).__name__)
    return environment


def prompt_messages(record: Mapping[str, Any]) -> list[Message]:
    """The opening turns of ``record``: its ``messages`` (or a ``prompt`` that is a chat, as
    TRL's conversational prompt-only records have it) without a last assistant turn, else
    its ``prompt`` or ``question`` text as a user turn. DataError when it has none."""
    for key in ("messages", "prompt"):
        chat = record.get(key)
        if isinstance(chat, list) and chat and all(isinstance(m, Mapping) for m in chat):
            turns = [dict(m) for m in chat]
            if turns[-1].get("role") == "assistant":
                turns = turns[:-1]
            if turns:
                return turns
    for key in ("prompt", "question"):
        if isinstance(record.get(key), str):
            return [{"role": "user", "content": record[key]}]
    raise DataError(
        f"a record needs 'messages', 'prompt' or 'question' to start an episode; it has "
        f"{', '.join(sorted(map(str, record))) or 'no keys'}"
    )


def _not_run(count: int, why: str) -> Message:
    """The one tool message answering ``count`` calls of a turn that did not run."""
    text = f"error: {count} more tool calls were not run: {why}"
    return {"role": "tool", "name": ERROR_NAME, "content": text}


def shown_name(name: str) -> str:
    """A tool name the model wrote, cut to :data:`MAX_NAME_CHARS` (with ``...``)."""
    return name if len(name) <= MAX_NAME_CHARS else f"{name[:MAX_NAME_CHARS]}..."


def final_answer(messages: Sequence[Message]) -> str | None:
    """The content of the last assistant message, None if there is none."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return None


def _structured(entry: Any) -> ToolCall | ToolCallError:
    """A ``tool_calls`` entry of a message (``{"function": {"name", "arguments"}}``, the
    arguments a dict or a JSON string) as a call."""
    function = entry.get("function", entry) if isinstance(entry, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        return ToolCallError('the tool call has no "name"')
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError) as exc:
            why = getattr(exc, "msg", "nested too deeply")
            return ToolCallError(f"the arguments of the call to {name} are not JSON ({why})", name)
    if not isinstance(arguments, dict):
        return ToolCallError(f"the arguments of the call to {name} must be a JSON object", name)
    return ToolCall(name, arguments)
