"""The built-in ``python`` environment: a :class:`~strop.agents.tool_env.ToolEnv` with one
tool, ``python(code)``, that runs the snippet in the sandbox
(:func:`strop.agents.sandbox.run_python`) and shows what it printed; scored on the final
answer like ``calculator`` (:func:`strop.agents.calculator.correct`).

A snippet that fails (it raised, exited non-zero, ran out of time, memory or output) is a tool
error: the model sees its output and ``[error: ...]``, and the step counts it in
``tool_errors``. The tool's own timeout is the sandbox's wall clock plus a margin, so the
sandbox, not the tool thread, ends a slow snippet.

The snippets read what other users may read (as root they run as a fresh uid; as another
user, as that user): :func:`warn_if_snippets_can_read` warns, at preflight, when that
includes the run's data files, whose gold answers the model could then print.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
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
logger = logging.getLogger(__name__)


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

    python.runs_model_code = True  # type: ignore[attr-defined]  # see warn_if_snippets_can_read
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


def warn_if_snippets_can_read(env: Any, paths: Iterable[str | None]) -> None:
    """A logged warning (not an error) for each file of ``paths`` a sandboxed snippet of
    ``env`` could read: ``env`` has a tool that runs the model's code (:func:`python_tool`),
    and the file is readable by others (its mode, and every directory above it, let other
    users reach and read it; or strop runs as another user than root, whose snippets read
    what that user reads). A data file holds the gold answers."""
    tools = getattr(env, "tools", None)
    tools = tools.values() if isinstance(tools, Mapping) else ()
    if not any(getattr(tool.function, "runs_model_code", False) for tool in tools):
        return
    for path in filter(None, paths):
        if os.path.exists(path) and (os.getuid() != 0 or _others_can_read(Path(path))):
            why = "strop runs as a user the snippets run as" if os.getuid() else "its mode"
            logger.warning(
                "%s is readable by the python tool's sandboxed snippets (%s): the model can "
                "print its gold answers; keep the data in a directory others cannot enter "
                "(chmod 700, as root), see docs/agents.md",
                path,
                why,
            )


def _others_can_read(path: Path) -> bool:
    path = path.resolve()
    reach = all(os.stat(d).st_mode & stat.S_IXOTH for d in path.parents)
    files = path.rglob("*") if path.is_dir() else [path]
    return reach and any(f.stat().st_mode & stat.S_IROTH for f in files if f.is_file())
