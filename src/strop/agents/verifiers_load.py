"""Loading a ``verifiers`` 0.4 taskset for ``env.name=verifiers:<module>`` and refusing, in
one line, what strop cannot play in process (see :mod:`strop.agents.verifiers_env`).

verifiers is imported here only when a ``verifiers:`` reference is used (it takes seconds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import inspect
import json
import threading
from collections.abc import Mapping
from typing import Any

from strop.agents.environment import EnvironmentLoadError
from strop.rewards.calling import one_line

ADAPTER_KEYS = ("max_turns", "tool_format", "tool_timeout_s", "max_output_chars")
SUPPORTED = (
    "strop plays single-agent verifiers 0.4 tasksets (verifiers.v1: a Taskset of Tasks with "
    "prompts, @vf.tool toolsets, @vf.reward and @vf.stop on the Trace)"
)
_LOADED: dict[tuple[str, str], Loaded] = {}
_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


@dataclasses.dataclass
class Loaded:
    """A module's taskset, loaded once: its task type, the task config, shared toolsets."""

    reference: str
    taskset: Any
    task_type: type
    data_type: type
    shared_toolsets: list[Any]


def import_module(reference: str, module: str) -> Any:
    """The environment's module (verifiers imported first); one line when either fails."""
    try:
        importlib.import_module("verifiers.v1")
    except ImportError as exc:
        raise EnvironmentLoadError(
            f"environment {reference!r}: needs the verifiers package, version 0.4 "
            f"(pip install 'strop[verifiers]'): {one_line(exc)}"
        ) from None
    # As verifiers' loader: a hub id's name (owner/name@version), a built-in taskset first.
    module = module.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_")
    builtin = f"verifiers.v1.tasksets.{module}"
    try:
        if "." not in module and importlib.util.find_spec(builtin):
            module = builtin
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise EnvironmentLoadError(
                f"environment {reference!r}: no module named {exc.name!r} on the Python path "
                "(install the environment's package, or run from its directory)"
            ) from None
        raise EnvironmentLoadError(
            f"environment {reference!r}: importing {module} failed: {one_line(exc)}"
        ) from None
    except Exception as exc:
        old = " (written for verifiers < 0.4? strop supports the 0.4 API, verifiers.v1)"
        hint = old if isinstance(exc, AttributeError | ImportError) else ""
        raise EnvironmentLoadError(
            f"environment {reference!r}: importing {module} failed: {one_line(exc)}{hint}"
        ) from None


def load(reference: str, module_name: str, args: Mapping[str, Any]) -> Loaded:
    """The module's taskset built with ``args`` (cached per module and arguments), checked
    to be a kind strop plays."""
    key = (module_name, json.dumps(dict(args), sort_keys=True, default=repr))
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _load(reference, import_module(reference, module_name), dict(args))
        return _LOADED[key]


def _load(reference: str, module: Any, args: dict[str, Any]) -> Loaded:
    import verifiers.v1 as vf

    def refuse(why: str) -> EnvironmentLoadError:
        return EnvironmentLoadError(f"environment {reference!r}: {why}; {SUPPORTED}")

    factory = getattr(module, "load_environment", None)
    if callable(factory):
        try:
            made = factory(**args)
        except Exception as exc:
            raise EnvironmentLoadError(
                f"environment {reference!r}: load_environment(...) failed: {one_line(exc)}"
            ) from None
        if isinstance(made, vf.SingleAgentEnv):
            made = made.taskset
        elif isinstance(made, vf.Env):
            raise refuse(f"load_environment() returned a {type(made).__name__} (a multi-agent env)")
        if not isinstance(made, vf.Taskset):
            raise refuse(f"load_environment() returned a {type(made).__name__}")
        taskset = made
    else:
        exported = [getattr(module, name, None) for name in getattr(module, "__all__", ())]
        classes = [c for c in exported if isinstance(c, type)]
        for base, what in ((vf.Env, "an Env (its own episode)"), (vf.Harness, "a Harness")):
            own = [c for c in classes if issubclass(c, base) and c is not vf.SingleAgentEnv]
            if own:
                raise refuse(f"{module.__name__} exports {what}, {own[0].__name__}")
        found = [c for c in classes if issubclass(c, vf.Taskset) and c is not vf.Taskset]
        if len(found) != 1:
            raise EnvironmentLoadError(
                f"environment {reference!r}: {module.__name__} must export one vf.Taskset "
                f"subclass in __all__ (found {len(found)}), or define load_environment()"
            )
        config_type = _config_type(found[0])
        try:
            config = config_type.model_validate({"id": module.__name__, **args})
            taskset = found[0](config)
        except Exception as exc:
            raise EnvironmentLoadError(
                f"environment {reference!r}: {found[0].__name__}({config_type.__name__}"
                f"(**env.args)) failed: {describe(exc)}"
            ) from None
    task_type = type(taskset).task_type()
    problem = _unsupported(task_type, taskset)
    if problem:
        raise refuse(problem)
    shared = list(type(taskset).toolsets(taskset.config))
    problem = _remote(shared)
    if problem:
        raise refuse(problem)
    for toolset in shared:
        run_sync(toolset.setup())
    return Loaded(reference, taskset, task_type, task_type.data_type(), shared)


def _config_type(taskset_type: type) -> type:
    from verifiers.v1 import Taskset, TasksetConfig
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(taskset_type, TasksetConfig, origin=Taskset) or TasksetConfig


def _unsupported(task_type: type, taskset: Any) -> str | None:
    """Why strop cannot play ``task_type``'s tasks in process, None when it can."""
    import verifiers.v1 as vf
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    name = task_type.__name__
    if task_type.NEEDS_CONTAINER:
        return f"its task {name} NEEDS_CONTAINER (a verifiers runtime)"
    for hook in ("setup", "finalize", "stage_verifier"):
        if getattr(task_type, hook) is not getattr(vf.Task, hook):
            return f"its task {name} has a {hook} hook (it runs in a verifiers runtime)"
    task = task_type(task_type.data_type().model_construct(), taskset.config.task)
    if discover_decorated(task, "intercept"):
        return f"its task {name} has @vf.intercept hooks (verifiers' interception server)"
    for fn in task.hooks("stop"):
        if hook_boundary(fn, allow_trace=True) is not vf.Trace:
            return f"its @vf.stop {fn.__name__} reads a Request or Response, not the Trace"
    for kind in ("reward", "metric"):
        for fn in task.hooks(kind):
            param = inspect.signature(fn).parameters.get("runtime")
            if param is not None and param.default is param.empty:
                return f"its @vf.{kind} {fn.__name__} takes a runtime (a verifiers sandbox)"
    if task.config.judges:
        return "its task has judges (they call a model through verifiers' client)"
    return _remote(task_type.toolsets(task.config))


def _remote(toolsets: list[Any]) -> str | None:
    for toolset in toolsets:
        if getattr(toolset.config, "url", None):
            return f"its toolset {type(toolset).__name__} is a remote server ({toolset.config.url})"
    return None


def verifiers_loop() -> asyncio.AbstractEventLoop:
    """The one event loop every verifiers coroutine of the process runs on: toolset
    ``setup``/``setup_task``, ``async def`` tools, stops and scoring. Started on first use
    in a daemon thread and kept, so a client or helper process a toolset's ``setup`` made
    (bound to its loop) still works when the tools call it, as in verifiers' own server."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="strop-verifiers", daemon=True).start()
            _LOOP = loop
        return _LOOP


def run_sync(awaitable: Any) -> Any:
    """``awaitable``'s result, run on :func:`verifiers_loop`, from a thread that is not the
    loop's (it blocks until the result is there)."""
    if not inspect.isawaitable(awaitable):
        return awaitable
    return asyncio.run_coroutine_threadsafe(_await(awaitable), verifiers_loop()).result()


async def run_async(awaitable: Any) -> Any:
    """``awaitable``'s result, run on :func:`verifiers_loop`, awaited from another loop."""
    if not inspect.isawaitable(awaitable):
        return awaitable
    future = asyncio.run_coroutine_threadsafe(_await(awaitable), verifiers_loop())
    return await asyncio.wrap_future(future)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def describe(exc: Exception) -> str:
    """A pydantic ValidationError as ``field: message`` items, anything else in one line."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return one_line(exc)
    items = [f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in errors()[:3]]
    return "; ".join(items)
