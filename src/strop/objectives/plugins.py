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
every mistake is one :class:`ValueError` line (the config names the setting), and an
exception the function raises when the update calls (or JAX traces) it is one
:class:`PolicyLossError` line naming the function, its file and line, and the exception. The
objective carries the reference string, and the function is looked up again (from the
cache) when the loss is traced, so the jit's static argument stays hashable.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import threading
from pathlib import Path

from strop.errors import StropError
from strop.objectives.losses import POLICY_LOSSES, PolicyLoss, check_declaration
from strop.references import (
    BadReference,
    import_function,
    not_a_function,
    one_line,
    source_file,
    split,
    type_and_text,
)


class PolicyLossError(StropError):
    """Your policy loss raised (exit code 2): the message names the function, the line of
    your file where it raised, and the exception."""


_LOADED: dict[tuple[str, str], PolicyLoss] = {}
_LOCK = threading.Lock()


def load(ref: str) -> PolicyLoss:
    """The :class:`PolicyLoss` of ``package.module:function`` or ``path/to/file.py:function``
    (cached per reference and working directory: a relative path names another file from
    elsewhere); a :class:`ValueError` naming what is wrong otherwise."""
    key = (os.getcwd(), ref)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = _load(ref)
        return _LOADED[key]


def _load(ref: str) -> PolicyLoss:
    parts = split(ref)
    if parts is None:
        raise ValueError(
            f"{ref!r}: expected a registered loss, package.module:function or "
            "path/to/file.py:function"
        )
    target, attr = parts
    found = import_function(target, attr, namespace="_strop_loss_", describe=_describe)
    fn, where = found.function, found.where
    if inspect.isclass(fn):
        raise BadReference(not_a_function(attr, where, fn))
    entry = getattr(fn, "strop_loss", None)
    if entry is None:
        entry = PolicyLoss(fn)
    elif not isinstance(entry, PolicyLoss) or not isinstance(entry.sequence_level, bool):
        raise ValueError(f"{attr!r} in {where}: declare its needs with @policy_loss(...)")
    check_declaration(entry)
    described = f"{attr}() in {where}"
    return dataclasses.replace(entry, fn=_reported(entry.fn, described, found.path))


def _reported(fn, described: str, file: Path | None):
    """``fn`` raising :class:`PolicyLossError` for what it raises (a :class:`StropError`
    passes through): one line at its deepest frame in ``file`` (a module's: its own)."""
    file = file or source_file(fn)

    @functools.wraps(fn)
    def call(ops, inputs, objective):
        try:
            return fn(ops, inputs, objective)
        except StropError:
            raise
        except Exception as exc:
            raise PolicyLossError(
                f"ppo.policy_loss: {described} raised at {one_line(exc, file)}"
            ) from None

    return call


def _describe(exc: BaseException, file: Path | None) -> str:
    """What an import raised: its type and text (a module's own import not found: the text)."""
    if file is None and isinstance(exc, ModuleNotFoundError):
        return str(exc)
    return type_and_text(exc)


def resolve_policy_loss(ref: str) -> PolicyLoss:
    """The :class:`PolicyLoss` ``ppo.policy_loss`` names: a registered one, or your own
    (``path/to/file.py:function``, ``package.module:function``: :func:`load`)."""
    if ref in POLICY_LOSSES:
        return POLICY_LOSSES[ref]
    if ":" not in ref:
        raise ValueError(
            f"unknown policy loss {ref!r}; the registered ones are {', '.join(POLICY_LOSSES)}, "
            "or give package.module:function or path/to/file.py:function"
        )
    return load(ref)
