"""Orbax's noise around a failed save or restore, kept to DEBUG: the one
:class:`~strop.errors.CheckpointError` line is what a user sees (``checkpoint.py`` raises
it). A failed write or read leaves TensorStore's other writes and reads running; they
fail later each with a page of traceback (asyncio's "never retrieved", the unraisable hook,
absl's ERROR logs, never-awaited coroutines at exit)."""

from __future__ import annotations

import atexit
import contextlib
import gc
import inspect
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class _StragglerFilter(logging.Filter):
    """Drops asyncio's "exception was never retrieved" reports of a failed save's other
    writes (they name the checkpoint directory), logging them at DEBUG instead."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()  # "... never retrieved\nfuture: <... exception=...>"
        error = record.exc_info[1] if record.exc_info else None
        if "never retrieved" in message and self.directory in f"{message} {error}":
            logger.debug("a failed save's other write failed too: %s", error)
            return False
        return True


class _LateWriterErrorFilter(logging.Filter):
    """Drops Orbax's ERROR reports (absl, with a traceback) of a failed save's other writer
    threads that fail after the save has already raised (a step's params and optimizer
    state are written by two threads; the second one's report can come once
    :func:`orbax_errors_quiet` is over), logging them at DEBUG instead. Only records that
    name the checkpoint directory are dropped."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.ERROR and self.directory in f"{record.getMessage()} {error}":
            logger.debug("a failed save's other writer failed too: %s", error)
            return False
        return True


_straggler_directories: set[Path] = set()
# Orbax's coroutines reading one array each: when a restore fails on one unreadable file,
# the others are closed unfinished and each raises its own read error again (a page each).
_ORBAX_READS = frozenset({"_read_array_index_and_device_put"})


def _quiet_stragglers_of_failed_saves(directory: Path) -> None:
    """Orbax raises a failed save's first write error while TensorStore's other writes
    are still in flight. They finish later, even after the save has returned: each one's
    callback hits Orbax's closed event loop (printed through ``sys.unraisablehook``) and
    asyncio reports the gathered errors as never retrieved, and another writer thread's
    failure can be logged (absl, ERROR) after the save raised. That is a page of tracebacks
    around the one CheckpointError line, so both kinds are kept to DEBUG (the asyncio ones
    only when they name this checkpoint directory), and so are a failed restore's other
    reads; anything else still reaches the previous hooks. Installed once per directory
    by the first save or restore."""
    if directory in _straggler_directories:
        return
    _straggler_directories.add(directory)
    logging.getLogger("asyncio").addFilter(_StragglerFilter(directory))
    logging.getLogger("absl").addFilter(_LateWriterErrorFilter(directory))
    if getattr(sys.unraisablehook, "_strop_straggler_hook", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            logger.debug("a failed save's write finished after its event loop closed")
            return
        reader = unraisable.object
        if type(reader) is types.CoroutineType and reader.cr_code.co_name in _ORBAX_READS:
            logger.debug("a failed restore's other read failed too: %s", error)
            return
        previous(unraisable)

    hook._strop_straggler_hook = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def quiet_unawaited_writes() -> None:
    """After a failed save: writes TensorStore had not started are coroutines nobody will
    await, and when one is collected (often at interpreter exit, after the error line)
    Python warns ``coroutine '...write_fragment' was never awaited`` on stderr, past any
    warnings filter at that point of the exit. The save's failure is already reported, so
    such coroutines are closed (which is all awaiting them would do now) right away and
    again when the process exits; other coroutines are left alone."""
    _close_unstarted_writes()
    if not getattr(_close_unstarted_writes, "registered", False):
        atexit.register(_close_unstarted_writes)
        _close_unstarted_writes.registered = True  # type: ignore[attr-defined]


def _close_unstarted_writes() -> None:
    for obj in gc.get_objects():
        if (
            type(obj) is types.CoroutineType  # not isinstance: no object's __class__ is read
            and obj.cr_code.co_name == "write_fragment"
            and inspect.getcoroutinestate(obj) == inspect.CORO_CREATED
        ):
            obj.close()


@contextlib.contextmanager
def orbax_errors_quiet(directory: Path) -> Iterator[None]:
    """Orbax logs a failed write's traceback from each writer thread (absl, ERROR) before
    raising it; the raised error becomes one CheckpointError line, so those are kept to
    DEBUG-level detail instead of pages on stderr (and so are the stragglers, see
    :func:`_quiet_stragglers_of_failed_saves`)."""
    _quiet_stragglers_of_failed_saves(directory)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        absl.setLevel(level)
