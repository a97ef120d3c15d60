"""The built-in ``python`` environment: a :class:`~strop.agents.tool_env.ToolEnv` with one
tool, ``python(code)``, that runs the snippet in the sandbox
(:func:`strop.agents.sandbox.run_python`) and shows what it printed; scored on the final
answer like ``calculator`` (:func:`strop.agents.calculator.correct`).

A snippet that fails (it raised, exited non-zero, ran out of time, memory or output) is a tool
error: the model sees its output and ``[error: ...]``, and the step counts it in
``tool_errors``. The tool's own timeout is the sandbox's wall clock plus a margin, so the
sandbox, not the tool thread, ends a slow snippet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from strop.agents.calculator import correct
from strop.agents.sandbox import SandboxLimits, run_python
from strop.agents.tool_env import ToolEnv
from strop.agents.tools import Tool, ToolOutcome
from strop.errors import ConfigError

SYSTEM_PROMPT = (
    "Solve the problem. You can call the python tool to run a Python program and see what it "
    "prints. When you know the answer, reply without a tool call and end with a line "
    "'#### <number>'."
)
TIMEOUT_MARGIN_S = 5.0


def python_tool(limits: SandboxLimits | None = None) -> Tool:
    """The ``python`` tool: each call runs in the sandbox under ``limits``."""
    limits = limits or SandboxLimits()

    def python(code: str) -> ToolOutcome:
        """Run a Python program in a sandbox and return what it printed.

        The program runs in a fresh process with no network, a temporary working directory
        and limits on time, memory, processes and output. Print what you want to see.

        Args:
            code: The Python source to run, for example "print(2**100)".
        """
        result = run_python(code, limits)
        parts = [result.stdout.rstrip("\n")] if result.stdout else []
        if result.stderr:
            parts.append(result.stderr.rstrip("\n"))
        if result.error:
            parts.append(f"[error: {result.error}]")
        return ToolOutcome("\n".join(parts) if parts else "(no output)", error=not result.ok)

    return Tool.from_function(python, timeout_s=limits.wall_time_s + TIMEOUT_MARGIN_S)


def python_environment(
    *,
    max_turns: int = 4,
    tool_format: str = "hermes",
    system_prompt: str | None = SYSTEM_PROMPT,
    limits: SandboxLimits | Mapping[str, Any] | None = None,
) -> ToolEnv:
    """The ``python`` environment (see the module docstring). ``limits``: the sandbox's, a
    :class:`SandboxLimits` or a mapping of its fields (``env.args={limits: {wall_time_s:
    2}}``); an unknown field is a one-line :class:`~strop.errors.ConfigError`."""
    if isinstance(limits, Mapping):
        known = {f.name for f in dataclasses.fields(SandboxLimits)}
        unknown = sorted(set(map(str, limits)) - known)
        if unknown:
            raise ConfigError(
                f"limits: unknown setting {unknown[0]!r}; the sandbox limits are "
                f"{', '.join(sorted(known))}"
            )
        limits = SandboxLimits(**limits)
    return ToolEnv(
        [python_tool(limits)],
        score=correct,
        system_prompt=system_prompt,
        max_turns=max_turns,
        tool_format=tool_format,
    )
