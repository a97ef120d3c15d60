"""Ctrl-C and SIGTERM: one line, exit 130 / 143, no traceback, no half-written checkpoint.

The CLI turns SIGTERM into :class:`Interrupted` (Ctrl-C is Python's ``KeyboardInterrupt``);
a training loop wraps its work in :func:`reporting_interrupts`, which names where the run
stopped::

    interrupted at step 13; the last complete checkpoint is step 10; run the same command to resume

:class:`Interrupted` is a ``BaseException``, like ``KeyboardInterrupt``, so that no
``except Exception`` on the way (a reward's containment, a checkpoint's error handling)
takes it for a failure to contain.

A checkpoint save is not interrupted: a signal that arrives during one
(:func:`deferred_interrupts`) takes effect when the save is complete, so the run resumes
from it. Had a save been cut anyway (a signal to a thread of its own, a library that
catches it), what it left is removed before the line is printed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from strop.io.checkpoint_dir import backends_with_checkpoints, remove_unfinished_saves


class Interrupted(BaseException):
    """The process was asked to stop (SIGINT or SIGTERM); exits with ``128 + signal``."""

    def __init__(self, signum: int, message: str = ""):
        self.signum = signum
        self.message = message or f"interrupted by {signal.Signals(signum).name}"
        super().__init__(self.message)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def raise_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Interrupted` in the main thread (a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupted)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs (a checkpoint save: writers on other
    threads must not be left writing into a directory the clean-up removes); the first
    one that arrived is raised as :class:`Interrupted` once the block has ended. A no-op
    off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    # A signal the process ignores stays ignored (a job started with `nohup` or `&` from a
    # script ignores SIGINT): deferring it would turn it into an interrupt.
    previous = {s: handler for s, handler in previous.items() if handler is not signal.SIG_IGN}
    for signum in previous:
        signal.signal(signum, lambda received, _frame: arrived.append(received))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if arrived:
        raise Interrupted(arrived[0])


@contextmanager
def reporting_interrupts(
    step: Callable[[], int], checkpoint_dir: str | os.PathLike, backend: str
) -> Iterator[None]:
    """Turn Ctrl-C / SIGTERM inside the block into :class:`Interrupted` that says at which
    ``step()`` the run stopped and which checkpoint it resumes from, after removing what a
    save cut short left in ``checkpoint_dir``."""
    try:
        yield
    except (KeyboardInterrupt, Interrupted) as stop:
        signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the clean-up finish
        try:
            remove_unfinished_saves(checkpoint_dir, backend)
        finally:
            signal.signal(signal.SIGINT, previous)
        steps = backends_with_checkpoints(checkpoint_dir).get(backend)
        resume = (
            f"the last complete checkpoint is step {steps[-1]}; run the same command to resume"
            if steps
            else "no checkpoint was written yet; the same command starts the run again"
        )
        raise Interrupted(signum, f"interrupted at step {step()}; {resume}") from None
