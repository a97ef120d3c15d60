"""The environment protocol of a multi-turn episode, and where an environment comes from.

An :class:`Environment` has two methods, each either plain or ``async def``:

* ``reset(record) -> list[message]``: the first messages of an episode (system and user
  turns, in the OpenAI / Hugging Face chat format) for one data record;
* ``step(messages) -> StepResult``: given the conversation so far, whose last message is
  the assistant's, the messages to add (tool results, a user turn), or ``None`` when the
  episode is over, with the reward parts of this turn and counters in ``info``;

and may have a third, ``finish(truncated=...) -> StepResult | None``, called once at the clean
end of an episode (``truncated``: whether a limit cut it): its rewards and info are the
episode's too (a game that scores at its end gives a budget-exhausted outcome there; see
:func:`~strop.agents.rollout.run_episodes`).

An instance holds the state of one episode at a time (``reset`` starts it); run several
episodes at once with several instances (:func:`resolve_environment` gives the factory,
which can be called once per episode). :func:`call_maybe_async` calls either kind of method.

:func:`load_environment` turns a reference into an instance:

* a built-in name (``calculator``, ``python``; see :data:`BUILTINS`);
* ``package.module:factory`` or ``path/to/file.py:factory`` (imported as
  :mod:`strop.references` imports rewards and losses): ``factory(**kwargs)`` must return an
  object with ``reset`` and ``step`` methods (a class is a factory too);
* an object of another framework's shape, for which an adapter is registered with
  :func:`register_adapter`: TRL's ``environment_factory`` environments (``reset(**row)``,
  tool methods, ``get_reward()``; :mod:`strop.agents.trl_env`, registered by
  :mod:`strop.agents`) are played as they are;
* ``<source>:<name>``, for a source registered with :func:`register_source`:
  ``verifiers:<module>`` is a ``verifiers`` 0.4 taskset, played in strop's loop
  (:mod:`strop.agents.verifiers_env`, registered by :mod:`strop.agents`; verifiers is
  imported only then). This module imports no source and no adapter: each registers
  itself, so the protocol sits below everything that plays it.

Every mistake raises :class:`EnvironmentLoadError`, one line naming the reference.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from strop.errors import ConfigError
from strop.references import BadReference, import_function, is_reference, one_line, split

Message = dict[str, Any]
T = TypeVar("T")

# Built-in environments: name -> "module:factory", imported when named.
BUILTINS: dict[str, str] = {
    "calculator": "strop.agents.calculator:calculator_environment",
    "python": "strop.agents.python_env:python_environment",
}


class EnvironmentLoadError(ConfigError):
    """An environment reference names nothing usable (one line, with the reference)."""


Source = Callable[[str, str], Callable[..., Any]]
"""``resolve(reference, name) -> factory``: a source's factory for ``<source>:<name>``
(``name`` stripped), :class:`EnvironmentLoadError` when it has none."""

SOURCES: dict[str, Source] = {}
"""The registered sources of environments, by the word before the colon (``verifiers``)."""


Adapter = Callable[[Any], Any]
"""``adapt(made) -> environment | None``: what a factory made, played as an environment, or
None when it is not the adapter's shape; :class:`EnvironmentLoadError` for one of its shape
that cannot be played."""

ADAPTERS: list[Adapter] = []
"""The registered adapters, tried in order on what a factory made without strop's ``reset``
and ``step``."""


def register_adapter(adapt: Adapter) -> None:
    """Play objects of another shape through ``adapt`` (see :data:`Adapter`)."""
    ADAPTERS.append(adapt)


def register_source(source: str, resolve: Source) -> None:
    """Make ``env.name=<source>:<name>`` resolve through ``resolve(reference, name)``
    (see :data:`Source`); ``source`` is a word a Python module path never takes the place
    of (a source named like a package would hide ``package:factory``)."""
    SOURCES[source] = resolve


@dataclass
class StepResult:
    """What one ``step`` returns: ``messages`` to add to the conversation (``None`` ends
    the episode), the reward parts earned this turn, and counters (``tool_calls``, ...)."""

    messages: list[Message] | None
    rewards: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.messages is None


@runtime_checkable
class Environment(Protocol):
    """``reset`` and ``step``, each plain or ``async def`` (see the module docstring)."""

    def reset(self, record: Mapping[str, Any]) -> list[Message] | Awaitable[list[Message]]: ...

    def step(self, messages: list[Message]) -> StepResult | Awaitable[StepResult]: ...


async def call_maybe_async(fn: Callable[..., T | Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, awaited when it returns an awaitable (an ``async def``)."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result  # type: ignore[return-value]


def is_environment(value: object) -> bool:
    """Whether ``value`` has callable ``reset`` and ``step`` attributes."""
    return callable(getattr(value, "reset", None)) and callable(getattr(value, "step", None))


def resolve_environment(reference: str) -> Callable[..., Any]:
    """The factory ``reference`` names (a built-in's, or the imported one), without calling
    it; :class:`EnvironmentLoadError` when there is none."""
    ref = reference.strip()
    source, colon, name = ref.partition(":")
    if colon and source.strip() in SOURCES:
        return SOURCES[source.strip()](ref, name.strip())
    if not is_reference(ref):
        if ref not in BUILTINS:
            hint = f"; give the factory too: {ref}:FACTORY" if ref.endswith(".py") else ""
            raise EnvironmentLoadError(
                f"environment {reference!r}: unknown built-in environment; the built-in ones "
                f"are {', '.join(sorted(BUILTINS))}, or give package.module:factory or "
                f"path/to/file.py:factory{hint}"
            )
        ref = BUILTINS[ref]
    parts = split(ref)
    if parts is None:
        raise EnvironmentLoadError(
            f"environment {reference!r}: expected a built-in name, package.module:factory or "
            "path/to/file.py:factory"
        )
    try:
        found = import_function(
            *parts,
            namespace="_strop_env_",
            describe=one_line,
            hint="; expected package.module:factory or path/to/file.py:factory",
        )
    except BadReference as exc:
        raise EnvironmentLoadError(f"environment {reference!r}: {exc}") from None
    return _adapting(found.function)


def _adapting(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory`` whose result, when it is no environment of strop's, is the first
    registered adapter's environment of it (:data:`ADAPTERS`)."""

    def make(**kwargs: Any) -> Any:
        made = factory(**kwargs)
        if is_environment(made) or inspect.isawaitable(made):
            return made
        for adapt in ADAPTERS:
            if (adapted := adapt(made)) is not None:
                return adapted
        return made

    make.__name__ = getattr(factory, "__name__", type(factory).__name__)
    return make


def load_environment(reference: str, **kwargs: Any) -> Any:
    """A new environment: the factory ``reference`` names, called with ``kwargs``, checked
    to have ``reset`` and ``step``. Raises :class:`EnvironmentLoadError` (one line)."""
    return new_environment(resolve_environment(reference), reference, **kwargs)


def new_environment(factory: Callable[..., Any], reference: str, **kwargs: Any) -> Any:
    """``factory`` (what ``reference`` names) called with ``kwargs``, the result checked to
    have ``reset`` and ``step``. Raises :class:`EnvironmentLoadError` (one line)."""
    name = getattr(factory, "__name__", type(factory).__name__)
    try:
        env = factory(**kwargs)
    except EnvironmentLoadError:
        raise
    except Exception as exc:
        raise EnvironmentLoadError(
            f"environment {reference!r}: {name}(...) failed: {one_line(exc)}"
        ) from None
    if inspect.isawaitable(env):
        close = getattr(env, "close", None)
        if callable(close):
            close()  # an unawaited coroutine would warn
        raise EnvironmentLoadError(
            f"environment {reference!r}: {name} is async; the factory must return the "
            "environment itself (its reset and step may be async)"
        )
    if not is_environment(env):
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        raise EnvironmentLoadError(
            f"environment {reference!r}: {name}(...) returned a {type(env).__name__}, which "
            f"has no {' or '.join(missing)} method; an environment has reset(record) and "
            "step(messages), or, as TRL's environment_factory, reset(**row) with tool methods "
            "or get_reward()"
        )
    return env
