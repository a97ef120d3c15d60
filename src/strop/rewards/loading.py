"""Where a reward comes from: a registered name, ``package.module:function`` or
``path/to/file.py:function``.

:func:`load` turns one such reference into a :class:`~strop.rewards.base.Reward`:

* a name without ``:`` is looked up in the registry (``gsm8k``, ``math``, ``format`` and
  anything :func:`~strop.rewards.register`\\ ed);
* ``package.module:function`` imports the module from the Python path (an installed
  package, or a directory on ``PYTHONPATH``) and takes the attribute;
* ``path/to/file.py:function`` (anything ending in ``.py`` or holding a ``/``) runs that
  file as a module, a path relative to the current directory or absolute. A file is run
  once per process, however often it is named;
* ``model:DIR`` is a reward model (:mod:`strop.rewards.model`): ``DIR`` is checked here,
  the model is built by the run's backend (``config``) when it first scores.

Every way this can fail (no such file or module, the import raised, no such attribute,
not callable, a class) raises :class:`~strop.rewards.base.RewardError`: one line that names
the setting, the reference and what to do. A function is named after its attribute
(``my_rewards.py:exact`` is ``exact``); it has no gold rule
(:class:`~strop.rewards.base.Gold`), so its data is never refused for lack of a gold answer.
With a deadline in ``limits`` (:class:`~strop.rewards.base.RewardLimits`) such a function
is called in a worker process that imports it again by its reference (a file by its
absolute path; :mod:`strop.rewards.isolated`); it is still imported here first, so that
every mistake above is found before anything loads.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from strop.errors import ConfigError
from strop.rewards.base import Reward, RewardError, RewardLimits, get, names
from strop.rewards.calling import one_line as _failure
from strop.rewards.model import NAME, PREFIX, ModelReward, check_directory, is_model_reference

_MODULE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_FILES: dict[Path, ModuleType] = {}  # resolved path -> the module it ran as
_FILES_LOCK = threading.Lock()
_MISSING = object()


def is_reference(text: str) -> bool:
    """Whether ``text`` names a function to import (it holds ``:``), not a registered name."""
    return ":" in text


def load(
    ref: str,
    *,
    setting: str = "reward",
    build_model: Callable[[Path], Any] | None = None,
    limits: RewardLimits | None = None,
) -> Reward:
    """A new :class:`Reward` (fresh counters) for ``ref``; ``setting`` (``ppo.reward``) is
    named in messages; ``build_model``: how the run builds a reward model (``model:DIR``)
    from its directory, at its first call; ``limits``: the run's (a function from a reference is called in a worker process
    when they set a deadline). Raises :class:`RewardError` (a :class:`ConfigError`)."""
    if is_model_reference(ref):
        directory = check_directory(ref.removeprefix(PREFIX), ref, setting)
        model = ModelReward(directory, ref, setting, build_model)
        return Reward(NAME, model, source=ref, limits=limits)
    if not is_reference(ref):
        try:
            return get(ref, limits)
        except ConfigError:
            hint = (
                f"; give the function too: {ref}:FUNCTION"
                if ref.endswith(".py")
                else "; or give package.module:function or path/to/file.py:function"
            )
            raise RewardError(
                f"{setting}={ref!r}: unknown reward; the registered ones are "
                f"{', '.join(names())}{hint}"
            ) from None
    target, _, attr = ref.rpartition(":")
    if not target or not attr.isidentifier():
        raise RewardError(
            f"{setting}={ref!r}: expected a registered name, package.module:function or "
            "path/to/file.py:function"
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        module, where = _run_file(target, ref, setting), target
        importable = f"{Path(target).expanduser().resolve()}:{attr}"
    elif _MODULE.fullmatch(target):
        module, where = _import_module(target, ref, setting), f"module {target}"
        importable = ref
    else:
        raise RewardError(
            f"{setting}={ref!r}: {target!r} is neither a module name nor a .py file; expected "
            "package.module:function or path/to/file.py:function"
        )
    fn = getattr(module, attr, _MISSING)
    if fn is _MISSING:
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(attr, defined, n=1)
        suggestion = f", did you mean {close[0]!r}?" if close else ""
        raise RewardError(f"{setting}={ref!r}: {where} has no function {attr!r}{suggestion}")
    if inspect.isclass(fn):
        raise RewardError(
            f"{setting}={ref!r}: {attr!r} in {where} is a class; name a function, or an "
            f"instance made in {where} (e.g. {attr.lower()} = {attr}())"
        )
    if not callable(fn):
        raise RewardError(
            f"{setting}={ref!r}: {attr!r} in {where} is a {type(fn).__name__}, not a function"
        )
    return Reward(attr, fn, source=ref, limits=limits, importable=importable)


def _run_file(target: str, ref: str, setting: str) -> ModuleType:
    path = Path(target).expanduser()
    resolved = path.resolve()
    if not resolved.is_file():
        what = "is not a file" if resolved.exists() else "does not exist"
        relative = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise RewardError(f"{setting}={ref!r}: {path} {what}{relative}")
    with _FILES_LOCK:
        if resolved in _FILES:
            return _FILES[resolved]
        digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
        stem = re.sub(r"\W", "_", resolved.stem)
        name = f"_strop_reward_{stem}_{digest}"
        spec = importlib.util.spec_from_file_location(name, resolved)
        if spec is None or spec.loader is None:
            raise RewardError(f"{setting}={ref!r}: cannot import {path} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up here
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise RewardError(
                f"{setting}={ref!r}: importing {path} failed: {_failure(exc, resolved)}"
            ) from None
        _FILES[resolved] = module
        return module


def _import_module(target: str, ref: str, setting: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(f"{exc.name}.")):
            raise RewardError(
                f"{setting}={ref!r}: no module named {exc.name!r} on the Python path "
                "(install it or add its directory to PYTHONPATH; a file is given as "
                "path/to/file.py:function)"
            ) from None
        raise RewardError(
            f"{setting}={ref!r}: importing module {target} failed: {_failure(exc)}"
        ) from None
    except Exception as exc:
        raise RewardError(
            f"{setting}={ref!r}: importing module {target} failed: {_failure(exc)}"
        ) from None
