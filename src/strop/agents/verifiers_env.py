"""``env.name=verifiers:<module>``: a ``verifiers`` 0.4 environment played by strop's loop.

verifiers 0.4 (``import verifiers.v1 as vf``) runs an episode as a *harness*: a program (by
default the ``bash`` coding agent, in a Prime sandbox) that reaches the model through an
OpenAI-compatible interception server and the task's tools as MCP servers. strop samples
token in, token out, on its own samplers, so it does not drive that stack. It takes the
environment's own parts and plays them as verifiers' tool-calling chat loop (the ``null``
harness) does, in this process:

* **Loading** (once per module and arguments): ``<module>`` is imported. A module with a
  ``load_environment(**args)`` returning a ``vf.Taskset`` (or a ``vf.SingleAgentEnv``, whose
  taskset is taken) is called; else its ``vf.Taskset`` subclass (exported in ``__all__``, as
  verifiers' loader wants) is built with ``env.args`` as its ``TasksetConfig`` fields.
  ``max_turns`` (4), ``tool_format`` (``hermes``), ``tool_timeout_s`` (10) and
  ``max_output_chars`` (4000) in ``env.args`` are strop's, as for ``calculator``.
* **reset(record)**: the record, validated as the task's ``TaskData`` (a taskset row:
  ``prompt``, ``system_prompt`` and the task's own fields), opens with its system prompt
  and prompt (text: one user turn). The tools are the ``@vf.tool`` methods of the task's
  toolsets (``Task.toolsets``: fresh ones per episode, ``setup`` and ``setup_task``
  awaited) and of the taskset's (``Taskset.toolsets``: set up once), named as verifiers'
  chat program names them (``<server>_<tool>``; the bare name under ``TOOL_PREFIX = None``)
  and called in this process with the episode's ``trace.state`` as their ``self.state``.
  Every verifiers coroutine (setup, ``async def`` tools, stops, scoring) runs on one
  long-lived loop (:func:`~strop.agents.verifiers_load.verifiers_loop`), each tool call in
  its own context holding its episode's state, as verifiers' own tool server runs them.
* **step**: :class:`~strop.agents.tool_env.ToolEnv`'s (no call ends the episode; calls are
  run and answered; ``max_turns`` cuts it), then the task's ``@vf.stop`` predicates over the
  ``vf.Trace`` (the step's tool results in it, as in verifiers' session) end it when one is
  true; the trace scored then holds those results.
* **Reward**: at the end, verifiers' own ``Task.score`` over a ``vf.Trace`` of the
  conversation (assistant turns with their parsed ``tool_calls``, the tool results); each
  reward (each key of one returning several) is a part, its score times its weight, as in
  ``trace.reward``, logged as ``reward/<name>``. A reward of weight 0 (a diagnostic: it
  adds nothing) and each ``@vf.metric`` go to ``info`` by their own score instead, logged
  as ``env/<name>``.

What needs verifiers' runtime, model client or interception server is refused in one line
(:class:`~strop.agents.environment.EnvironmentLoadError`) at load: an exported ``vf.Env``
(a multi-agent or custom episode) or ``vf.Harness``, a task that ``NEEDS_CONTAINER`` or has
``setup``/``finalize`` hooks, ``@vf.intercept`` hooks, ``@vf.stop`` on a ``Request`` or
``Response``, rewards or metrics that take a ``runtime``, judges, and a remote toolset.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

from strop.agents.environment import EnvironmentLoadError, Message, StepResult
from strop.agents.tool_calls import ToolCall, format_name, parse_tool_calls
from strop.agents.tool_env import ToolEnv
from strop.agents.tools import DEFAULT_MAX_OUTPUT_CHARS, DEFAULT_TIMEOUT_S, Tool
from strop.agents.verifiers_load import (
    ADAPTER_KEYS,
    Loaded,
    describe,
    import_module,
    load,
    run_async,
    run_sync,
)
from strop.errors import DataError


def verifiers_factory(reference: str, module: str) -> Callable[..., VerifiersEnv]:
    """The factory of ``reference``, ``verifiers:<module>``: ``factory(**env.args)`` is one
    episode's environment. The module is imported now (a missing one is one line)."""
    if not module:
        raise EnvironmentLoadError(
            f"environment {reference!r}: name the module after 'verifiers:', e.g. "
            "verifiers:my_env (a package exporting its vf.Taskset subclass)"
        )
    import_module(reference, module)

    def verifiers(**kwargs: Any) -> VerifiersEnv:
        options = {key: kwargs.pop(key) for key in ADAPTER_KEYS if key in kwargs}
        return VerifiersEnv(load(reference, module, kwargs), **options)

    return verifiers


class VerifiersEnv(ToolEnv):
    """One episode of a loaded verifiers taskset (see the module docstring)."""

    def __init__(
        self,
        loaded: Loaded,
        *,
        max_turns: int = 4,
        tool_format: str = "hermes",
        tool_timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        super().__init__([], max_turns=max_turns, tool_format=tool_format)
        self.loaded = loaded
        self.limits = {"timeout_s": tool_timeout_s, "max_output_chars": max_output_chars}
        self.task: Any = None
        self.trace: Any = None

    async def reset(self, record: Mapping[str, Any]) -> list[Message]:
        import verifiers.v1 as vf
        from verifiers.v1.state import state_cls

        loaded = self.loaded
        try:
            data = loaded.data_type.model_validate(dict(record))
        except Exception as exc:
            raise DataError(
                f"a record is not a {loaded.data_type.__name__} of {loaded.reference!r}: "
                f"{describe(exc)}"
            ) from None
        task = loaded.task_type(data, loaded.taskset.config.task)
        if loaded.taskset.system_prompt is not None:
            task = task.with_system_prompt(loaded.taskset.system_prompt)
        self.record, self.task = record, task
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
        )
        own = list(type(task).toolsets(task.config))
        for toolset in own:
            await run_async(toolset.setup())
            await run_async(toolset.setup_task(task))
        self.tools = {}
        for toolset in (*loaded.shared_toolsets, *own):
            for tool in self._tools_of(toolset):
                if tool.name in self.tools:
                    raise DataError(f"two tools of {loaded.reference} are named {tool.name!r}")
                self.tools[tool.name] = tool
        opening: list[Message] = []
        if data.system_prompt:
            opening.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            opening.append({"role": "user", "content": data.prompt})
        else:
            opening += [m.model_dump(exclude_none=True) for m in data.prompt or []]
        if not opening:
            raise DataError(f"a record of {loaded.reference} has no prompt and no system prompt")
        return opening

    def _tools_of(self, toolset: Any) -> list[Tool]:
        from verifiers.v1.mcp.server import _call_state
        from verifiers.v1.utils.decorators import discover_decorated

        prefix = toolset.server_name
        tools = []
        for method in discover_decorated(toolset, "tool"):
            raw = getattr(method, "tool_name", None) or method.__name__
            name = f"{prefix}_{raw}" if prefix else raw
            tool = Tool.from_function(
                method, name=name, description=(method.__doc__ or "").strip(), **self.limits
            )
            state = self.trace.state if toolset._state_cls is type(self.trace.state) else None

            def call(_method: Any = method, _state: Any = state, **kwargs: Any) -> Any:
                if inspect.iscoroutinefunction(_method):  # its body runs on the loop
                    return run_sync(_in_state(_state, _method(**kwargs)))
                token = _call_state.set(_state)  # a plain tool runs here, in its thread
                try:
                    result = _method(**kwargs)
                finally:
                    _call_state.reset(token)
                return run_sync(_in_state(_state, result))

            tools.append(dataclasses.replace(tool, function=call))
        return tools

    async def step(self, messages: list[Message]) -> StepResult:
        result = await super().step(messages)
        if result.messages is None:
            self._record(messages)
        else:  # stops see the step's tool results, and a stopped trace is scored with them
            self._record(messages + result.messages)
            if not await self._stopped():
                return result
        await run_async(self.task.score(self.trace))
        rewards, info = {}, dict(result.info)
        for name, reward in self.trace.rewards.items():
            if reward is not None and reward.weight == 0:  # a diagnostic: its own score
                info[name] = reward.score
            elif reward is not None:
                rewards[name] = reward.value
        info.update(
            {name: value for name, value in self.trace.metrics.items() if value is not None}
        )
        return StepResult(None, rewards, info)

    async def _stopped(self) -> bool:
        from verifiers.v1.session import call_hook
        from verifiers.v1.trace import Trace

        for fn in self.task.hooks("stop"):
            if await run_async(call_hook(fn, {Trace: self.trace})):
                self.trace.stop(fn.__name__)
                return True
        return False

    def _record(self, messages: list[Message]) -> None:
        """``self.trace``'s nodes: the conversation, one chain (see :func:`trace_messages`)."""
        import verifiers.v1 as vf
        from pydantic import TypeAdapter

        adapter = TypeAdapter(vf.Message)
        chat = trace_messages(messages, self.tool_format)
        self.trace.nodes = [
            vf.MessageNode(
                parent=i - 1 if i else None,
                message=adapter.validate_python(message),
                sampled=message["role"] == "assistant",
            )
            for i, message in enumerate(chat)
        ]


def trace_messages(messages: list[Message], tool_format: str) -> list[Message]:
    """The conversation as verifiers' chat program records it: each assistant turn's calls
    (read from its text) as ``tool_calls`` with ids, each tool result with its call's id."""
    fmt, out, pending, n = format_name(tool_format), [], [], 0
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            parsed = parse_tool_calls(str(message.get("content") or ""), fmt)
            calls = []
            for call in parsed.calls:
                arguments = json.dumps(call.arguments) if isinstance(call, ToolCall) else ""
                calls.append(
                    {"id": f"call_{n}", "name": call.name or "error", "arguments": arguments}
                )
                n += 1
            pending = [c["id"] for c in calls]
            out.append(
                {"role": "assistant", "content": parsed.content, "tool_calls": calls or None}
            )
        elif role == "tool":
            call_id = pending.pop(0) if pending else f"call_{n}"
            out.append({
                "role": "tool", "tool_call_id": call_id,
                "content": str(message.get("content", "")), "name": message.get("name"),
            })  # fmt: skip
        else:
            out.append({"role": role, "content": message.get("content") or ""})
    return out


async def _in_state(state: Any, value: Any) -> Any:
    """``value`` awaited (when it is awaitable) with ``state`` as verifiers' current call
    state (``Toolset.state``), in this task's own context, as verifiers' server does."""
    from verifiers.v1.mcp.server import _call_state

    token = _call_state.set(state)
    try:
        return await value if inspect.isawaitable(value) else value
    finally:
        _call_state.reset(token)
