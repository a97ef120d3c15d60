"""Importing a function a user names: ``package.module:function`` or
``path/to/file.py:function`` (a reward, :mod:`strop.rewards.loading`; a policy loss,
:mod:`strop.objectives.plugins`).

* ``package.module:function`` imports the module from the Python path (an installed
  package, or a directory on ``PYTHONPATH``) and takes the attribute;
* ``path/to/file.py:function`` (anything ending in ``.py`` or holding a ``/``) runs that
  file as a module, a path relative to the current directory or absolute. A file is run
  once per process and namespace, however often it is named.

Every way this can fail (no such file or module, the import raised, no such attribute — with
the closest name defined there —, not callable) raises :class:`BadReference`: one line, without
the setting or the reference, which the caller adds as its messages put them. What the
function raises when it is called is :func:`one_line` too, at its line in the user's file.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import re
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

_MODULE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_FILES: dict[tuple[str, Path], ModuleType] = {}  # (namespace, resolved path) -> its module
_FILES_LOCK = threading.Lock()
_MISSING = object()


class BadReference(ValueError):
    """What is wrong with a reference, in one line."""


@dataclass(frozen=True)
class Found:
    """An imported function: ``where`` is how messages name its place (``my.py``,
    ``module pkg.mod``); ``path`` the resolved file of a file reference (else None)."""

    function: Callable[..., Any]
    where: str
    path: Path | None


def is_reference(text: str) -> bool:
    """Whether ``text`` names a function to import (it holds ``:``), not a registered name."""
    return ":" in text


def split(ref: str) -> tuple[str, str] | None:
    """``(target, attribute)`` of ``target:attribute``; None where it is not of that form."""
    target, _, attr = ref.rpartition(":")
    return (target, attr) if target and attr.isidentifier() else None


def type_and_text(exc: BaseException, file: Path | None = None) -> str:
    """``ZeroDivisionError: division by zero`` (``file``, the one imported, unused)."""
    return f"{type(exc).__name__}: {exc}"


def source_file(fn: Callable[..., Any]) -> Path | None:
    """The file ``fn``'s code is in (a callable object's ``__call__``'s), if it has code."""
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    return Path(code.co_filename) if code is not None else None


def one_line(exc: BaseException, file: Path | None = None) -> str:
    """``file.py:3: ZeroDivisionError: division by zero``: what a user's function raised, in
    one line, at the deepest frame in ``file`` (else the deepest frame of all)."""
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}:{exc.lineno}: " if exc.filename else ""
        return f"{where}SyntaxError: {exc.msg}"
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if file is not None and Path(f.filename) == file] or frames[-1:]
    where = f"{mine[-1].filename}:{mine[-1].lineno}: " if mine else ""
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{where}{type(exc).__name__}: {text}" if text else f"{where}{type(exc).__name__}"


def not_a_function(attr: str, where: str, value: object) -> str:
    return f"{attr!r} in {where} is a {type(value).__name__}, not a function"


def import_function(
    target: str,
    attr: str,
    *,
    namespace: str,
    describe: Callable[[BaseException, Path | None], str] = type_and_text,
    hint: str = "",
) -> Found:
    """The callable ``attr`` of ``target`` (a module name or a ``.py`` file, run as the module
    ``{namespace}{stem}_{digest}``); ``describe`` turns what an import raised into its part
    of the message (the file imported, for a file), ``hint`` follows the message of a target
    that is neither."""
    if target.endswith(".py") or "/" in target or "\\" in target:
        module, path = _run_file(target, namespace, describe)
        where = target
    elif _MODULE.fullmatch(target):
        module, where, path = _import_module(target, describe), f"module {target}", None
    else:
        raise BadReference(f"{target!r} is neither a module name nor a .py file{hint}")
    fn = getattr(module, attr, _MISSING)
    if fn is _MISSING:
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(attr, defined, n=1)
        suggestion = f", did you mean {close[0]!r}?" if close else ""
        raise BadReference(f"{where} has no function {attr!r}{suggestion}")
    if not callable(fn):
        raise BadReference(not_a_function(attr, where, fn))
    return Found(fn, where, path)


def _run_file(target: str, namespace: str, describe: Callable) -> tuple[ModuleType, Path]:
    path = Path(target).expanduser()
    resolved = path.resolve()
    if not resolved.is_file():
        what = "is not a file" if resolved.exists() else "does not exist"
        relative = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise BadReference(f"{path} {what}{relative}")
    with _FILES_LOCK:
        if (namespace, resolved) in _FILES:
            return _FILES[namespace, resolved], resolved
        digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
        stem = re.sub(r"\W", "_", resolved.stem)
        name = f"{namespace}{stem}_{digest}"
        spec = importlib.util.spec_from_file_location(name, resolved)
        if spec is None or spec.loader is None:
            raise BadReference(f"cannot import {path} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up here
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise BadReference(f"importing {path} failed: {describe(exc, resolved)}") from None
        _FILES[namespace, resolved] = module
        return module, resolved


def _import_module(target: str, describe: Callable) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(f"{exc.name}.")):
            raise BadReference(
                f"no module named {exc.name!r} on the Python path (install it or add its "
                "directory to PYTHONPATH; a file is given as path/to/file.py:function)"
            ) from None
        raise BadReference(f"importing module {target} failed: {describe(exc, None)}") from None
    except Exception as exc:
        raise BadReference(f"importing module {target} failed: {describe(exc, None)}") from None
