"""Your own policy loss: ``ppo.policy_loss=path/to/file.py:function`` or
``package.module:function``.

The function has a registered loss's signature, ``fn(ops, inputs, objective) ->
(per_token [B, L], terms)`` over :class:`~strop.objectives.losses.ArrayOps` (see
:class:`~strop.objectives.losses.PolicyLoss`), so the same code runs on JAX (traced inside
``jit``) and on torch. Its needs are declared with the
:func:`~strop.objectives.losses.policy_loss` decorator (``reads``: the update arrays it
reads beyond the ones every loss gets; ``sequence_level``: it gets ``segments``); a
function without it needs nothing more. :func:`load` imports the function (a file runs
once per process) and checks those needs when the config is read, before any model loads:
every mistake is one :class:`ValueError` line (the config names the setting). The
objective carries the reference string, and the function is looked up again (from the
cache) when the loss is traced, so the jit's static argument stays hashable.
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
from pathlib import Path
from types import ModuleType

from strop.objectives.losses import PolicyLoss, check_reads

_MODULE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_LOADED: dict[str, PolicyLoss] = {}
_LOCK = threading.Lock()


def is_reference(text: str) -> bool:
    """Whether ``text`` names a function to import (it holds ``:``), not a registered loss."""
    return ":" in text


def load(ref: str) -> PolicyLoss:
    """The :class:`PolicyLoss` of ``package.module:function`` or ``path/to/file.py:function``
    (cached per reference); a :class:`ValueError` naming what is wrong otherwise."""
    with _LOCK:
        if ref not in _LOADED:
            _LOADED[ref] = _load(ref)
        return _LOADED[ref]


def _load(ref: str) -> PolicyLoss:
    target, _, attr = ref.rpartition(":")
    if not target or not attr.isidentifier():
        raise ValueError(
            f"{ref!r}: expected a registered loss, package.module:function or "
            "path/to/file.py:function"
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        module, where = _run_file(target), target
    elif _MODULE.fullmatch(target):
        module, where = _import_module(target), f"module {target}"
    else:
        raise ValueError(f"{target!r} is neither a module name nor a .py file")
    fn = getattr(module, attr, None)
    if fn is None:
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(attr, defined, n=1)
        suggestion = f", did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where} has no function {attr!r}{suggestion}")
    if inspect.isclass(fn) or not callable(fn):
        raise ValueError(f"{attr!r} in {where} is a {type(fn).__name__}, not a function")
    entry = getattr(fn, "strop_loss", None)
    if entry is None:
        return PolicyLoss(fn)
    if not isinstance(entry, PolicyLoss) or not isinstance(entry.sequence_level, bool):
        raise ValueError(f"{attr!r} in {where}: declare its needs with @policy_loss(...)")
    check_reads(entry.reads)
    return entry


def _run_file(target: str) -> ModuleType:
    path = Path(target).expanduser()
    resolved = path.resolve()
    if not resolved.is_file():
        what = "is not a file" if resolved.exists() else "does not exist"
        relative = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ValueError(f"{path} {what}{relative}")
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"_strop_loss_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    return module


def _import_module(target: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(f"{exc.name}.")):
            raise ValueError(
                f"no module named {exc.name!r} on the Python path (install it or add its "
                "directory to PYTHONPATH; a file is given as path/to/file.py:function)"
            ) from None
        raise ValueError(f"importing module {target} failed: {exc}") from None
    except Exception as exc:
        raise ValueError(f"importing module {target} failed: {type(exc).__name__}: {exc}") from None
