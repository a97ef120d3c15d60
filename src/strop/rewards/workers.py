"""The parent's side of the verifier worker processes of :mod:`strop.rewards.pool`.

:class:`Worker` wraps one child process running ``_verify_worker.py`` and speaks its
length-prefixed JSON protocol; :func:`kill` SIGKILLs and reaps one; :data:`spawner` starts
them from one long-lived thread (see :class:`Spawner` for why).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import struct
import subprocess
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")


class Worker:
    """One child process and the parent's end of its pipes: length-prefixed frames, JSON
    unless ``encode``/``decode`` say otherwise (the reward-call worker's are pickles)."""

    def __init__(
        self,
        proc: subprocess.Popen,
        now: float,
        *,
        encode: Callable[[Any], bytes] = lambda message: json.dumps(message).encode(),
        decode: Callable[[bytes], Any] = json.loads,
    ):
        self.proc = proc
        self.encode, self.decode = encode, decode
        assert proc.stdout is not None and proc.stdin is not None
        self.fd = proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = bytearray()
        self.started = now
        self.ready = False
        self.item: int | None = None  # index of the pair it is checking
        self.since = 0.0  # when it was handed that pair

    def send(self, message: Any) -> None:
        self.write(self.encode(message))

    def write(self, data: bytes) -> None:
        """Send one frame of already encoded ``data``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        self.proc.stdin.flush()

    def receive(self) -> list[Any] | None:
        """The complete messages that arrived; ``None`` once the worker closed its stdout."""
        eof = False
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self.buffer += chunk
        messages = []
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            if len(self.buffer) < _HEADER.size + size:
                break
            messages.append(self.decode(self.buffer[_HEADER.size : _HEADER.size + size]))
            del self.buffer[: _HEADER.size + size]
        if eof and not messages:
            return None
        return messages


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL and reap ``proc``; close its pipes. Never raises."""
    with contextlib.suppress(OSError):
        proc.kill()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        logger.warning("verifier worker %d did not exit after SIGKILL", proc.pid)


class Spawner:
    """Starts processes from one long-lived daemon thread.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started a process exits, not the
    process. Starting workers from whichever thread happened to call the pool (a short-lived
    executor thread, say) would get them killed when that thread ends; this thread lives as
    long as the interpreter.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._requests = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._serve,
                    args=(self._requests,),
                    name="strop-verify-spawner",
                    daemon=True,
                )
                self._thread.start()
                self._pid = os.getpid()
            requests = self._requests
        reply: queue.SimpleQueue = queue.SimpleQueue()
        requests.put((args, kwargs, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    @staticmethod
    def _serve(requests: queue.SimpleQueue) -> None:
        while True:
            args, kwargs, reply = requests.get()
            try:
                reply.put((True, subprocess.Popen(*args, **kwargs)))
            except BaseException as exc:
                reply.put((False, exc))


spawner = Spawner()
