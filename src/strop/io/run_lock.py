"""One job per run directory: an OS advisory lock held for the job's whole life.

``strop sft``, ``ppo``, ``eval`` and ``demo`` take an exclusive ``flock`` on
``<run_dir>/.strop.lock`` before they read a tokenizer, data or weights, and write their
pid, host and start time into it. A second job on the same run directory is refused at
once (:class:`~strop.errors.RunDirInUseError`, exit 2) with the holder named. The OS drops
the lock of a process that dies (SIGKILL, a crash), so the next job takes the directory
over and logs whose lock it was; a job that ends normally empties the file.

In a run of several processes only the main one holds the lock (the backends'
``write_once`` shares its outcome with the others). Nested jobs of one process (the demo
runs PPO) share the lock it already holds.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from strop.errors import ConfigError, RunDirInUseError
from strop.io.writable import require_writable_dir, require_writable_parent

logger = logging.getLogger(__name__)

LOCK_FILE = ".strop.lock"

_held: dict[Path, tuple[int, int]] = {}  # lock path -> (file descriptor, nesting depth)


def take(run_dir: str | os.PathLike, checkpoints: Path | None = None) -> None:
    """Refuse, in one line (:mod:`strop.io.writable`), a run directory the job could not
    write (metrics, eval results, W&B's files) and a training job's ``checkpoints``
    directory, then take ``run_dir``'s lock (:func:`acquire`)."""
    require_writable_dir(run_dir, "run_dir")
    if checkpoints is not None:
        if checkpoints.is_dir():
            require_writable_dir(checkpoints, "checkpoint.dir")
        else:  # made by the first save
            require_writable_parent(checkpoints, "checkpoint.dir")
    acquire(run_dir)


def acquire(run_dir: str | os.PathLike) -> None:
    """Take ``run_dir``'s lock for this process (again, if it holds it already)."""
    path = (Path(run_dir) / LOCK_FILE).absolute()
    if path in _held:
        fd, depth = _held[path]
        _held[path] = (fd, depth + 1)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(
            f"run_dir {path.parent}: cannot create it or its lock file: {err}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by another process
        holder = _describe(_read(fd))
        os.close(fd)
        raise RunDirInUseError(
            f"run_dir {path.parent} is in use by another strop job ({holder}); wait for it "
            "to finish or stop it, or give this job another run_dir"
        ) from None
    previous = _read(fd)
    if previous:
        logger.warning(
            "taking over run_dir %s from a job that ended without releasing it (%s)",
            path.parent, _describe(previous),
        )  # fmt: skip
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_this_job()).encode(), 0)
    _held[path] = (fd, 1)


def release(run_dir: str | os.PathLike) -> None:
    """Give back what :func:`acquire` took; the outermost release empties and unlocks."""
    path = (Path(run_dir) / LOCK_FILE).absolute()
    if path not in _held:
        return
    fd, depth = _held.pop(path)
    if depth > 1:
        _held[path] = (fd, depth - 1)
        return
    os.ftruncate(fd, 0)  # an empty lock file: the last job ended normally
    os.close(fd)


@contextmanager
def holding(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the body (this process only; see the module doc)."""
    acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir)


def _this_job() -> dict[str, object]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


def _read(fd: int) -> dict[str, object]:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def _describe(job: dict[str, object]) -> str:
    if not job:
        return "pid unknown"
    started = job.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        if isinstance(started, int | float)
        else "unknown"
    )
    return f"pid {job.get('pid')} on {job.get('host')}, started {when}"
