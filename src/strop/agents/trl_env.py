"""TRL's ``environment_factory`` shape, played as it is: ``env.name=envs.py:MyEnv`` where
``MyEnv`` is written for TRL's ``GRPOTrainer(environment_factory=MyEnv)``.

Such an environment (TRL 1.x's contract, ``GRPOTrainer``'s docstring and "Environments" guide)
is an object with

* ``reset(**row)``: called with every column of the episode's record as a keyword argument;
  it returns None or a string, which is appended to the last message of the record's prompt
  (a chat ``prompt``, as TRL's conversational records have it, or ``prompt``/``question``
  text as a user turn; none: an empty user turn, so that the string is the prompt);
* its public methods (not ``reset``, not ``get_reward``, not starting with ``_``): the
  episode's tools, each made by :meth:`~strop.agents.tools.Tool.from_function` from its type
  hints and docstring, as TRL makes them with transformers' ``get_json_schema``;
* optionally ``get_reward()`` (plain or ``async def``): the episode's score from the
  environment's own state, called once when the episode ends, however it ends (cut by a
  limit too, as TRL calls it once per completed rollout), and logged under the class's name
  (``reward/IncrementEnv``) with weight 1, as TRL names and weighs it.

:class:`TrlEnvironment` plays it as a :class:`~strop.agents.tool_env.ToolEnv`: a reply
without a tool call ends the episode, calls run (errors are observations the model reads),
``env.max_turns`` and ``env.max_episode_tokens`` cut it; calls are read in the ``hermes``
format (Qwen's). :func:`trl_environment` is the adapter :mod:`strop.agents` registers: what
a factory made with ``reset``, no ``step``, and tool methods or ``get_reward`` is taken for
this shape. A TRL environment with a tool named ``step`` reads as strop's protocol: rename it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from strop.agents.environment import Message, StepResult
from strop.agents.tool_env import ToolEnv, prompt_messages
from strop.agents.tools import Tool
from strop.errors import DataError

RESERVED = frozenset({"reset", "get_reward"})  # TRL's methods that are not tools
_UNLIMITED_TURNS = 1 << 30  # the run's env.max_turns cuts an episode, as TRL's loop does

_TOOLS: dict[Callable[..., Any], Tool] = {}
"""A method's tool, built once per function (building one costs more than a cheap call) and
bound to each instance with :func:`dataclasses.replace`."""


def trl_environment(env: Any) -> TrlEnvironment | None:
    """``env`` played as TRL's shape, or None when it is not one: it has no ``reset``, has
    strop's ``step``, or has neither a tool method nor ``get_reward`` (nothing for the model
    to do or be scored by)."""
    if not callable(getattr(env, "reset", None)) or callable(getattr(env, "step", None)):
        return None
    if not _tool_methods(env) and not callable(getattr(env, "get_reward", None)):
        return None
    return TrlEnvironment(env)


class TrlEnvironment(ToolEnv):
    """One episode of a TRL ``environment_factory`` environment (see the module docstring)."""

    def __init__(self, env: Any) -> None:
        super().__init__(
            [_bound_tool(method) for method in _tool_methods(env)], max_turns=_UNLIMITED_TURNS
        )
        self.get_reward = getattr(env, "get_reward", None)
        self.env = env
        self.name = type(env).__name__

    async def reset(self, record: Mapping[str, Any]) -> list[Message]:
        self.record = record
        observation = await _off_the_loop(self.env.reset, **record)
        if observation is not None and not isinstance(observation, str):
            raise DataError(
                f"{self.name}.reset returned a {type(observation).__name__}; TRL's reset "
                "returns None or the text to append to the prompt"
            )
        try:
            opening = prompt_messages(record)
        except DataError:  # no prompt: the environment's text is the prompt, as in TRL
            opening = [{"role": "user", "content": ""}]
        if observation:
            last = opening[-1]
            opening[-1] = {**last, "content": f"{last.get('content') or ''}{observation}"}
        return opening

    async def finish(self, *, truncated: bool) -> StepResult | None:
        """``get_reward()``, once, however the episode ended (None: no part)."""
        if not callable(self.get_reward):
            return None
        value = await _off_the_loop(self.get_reward)
        if value is None:
            return None
        if isinstance(value, numbers.Real):  # a bool, an int, a numpy scalar: as TRL takes it
            value = float(value)
        if not isinstance(value, float) or not math.isfinite(value):
            raise DataError(f"{self.name}.get_reward returned {value!r:.80}, not a finite number")
        return StepResult(None, {self.name: value})


async def _off_the_loop(method: Callable[..., Any], **kwargs: Any) -> Any:
    """``method(**kwargs)``: awaited when ``async def``, else in a worker thread of the loop's
    pool, so that a slow plain ``reset`` (a game server to reach) holds up no other episode."""
    if inspect.iscoroutinefunction(method):
        return await method(**kwargs)
    return await asyncio.to_thread(method, **kwargs)


def _tool_methods(env: Any) -> list[Any]:
    """``env``'s tools as TRL finds them: its public bound methods but ``reset`` and
    ``get_reward``."""
    return [
        method
        for name, method in inspect.getmembers(env, predicate=inspect.ismethod)
        if name not in RESERVED and not name.startswith("_")
    ]


def _bound_tool(method: Any) -> Tool:
    function = method.__func__
    tool = _TOOLS.get(function)
    if tool is None:
        tool = _TOOLS[function] = Tool.from_function(method)
    return dataclasses.replace(tool, function=method)
