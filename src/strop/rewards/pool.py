"""A small pool of killable worker processes that run math-verify under a deadline.

Why not call math-verify in-process: its own timeouts use ``signal.alarm``, which only works
in the main thread, cannot interrupt a long computation inside C code (a power tower such as
``9^{9^{9^{9}}}`` makes sympy compute a gigantic integer), and some inputs exhaust memory.
Why not :class:`concurrent.futures.ProcessPoolExecutor`: it cannot cancel a running task, and
killing one of its processes breaks the whole executor.

So each worker is a plain child process (``python -P _verify_worker.py``, started with
:mod:`subprocess`, so the trainer's ``__main__`` is never re-imported the way
:mod:`multiprocessing`'s spawn and forkserver start methods do) that reads one request at a
time from its stdin and answers on its stdout. The pool hands one item to each idle worker,
waits on all their pipes with ``select``, and when an item has run longer than
``deadline_s`` it SIGKILLs that worker, reaps it, records the item as
:attr:`Verdict.TIMEOUT` and starts a fresh worker. A worker that dies mid-item (killed by the
OOM killer, its memory cap, a crash) makes that item :attr:`Verdict.ERROR`. The deadline
runs from the moment the item is handed to a ready worker, so start-up (about half a second,
done in the background) is never charged to an item.

Lifecycle: workers start on first use, :meth:`VerifierPool.close` (or leaving the ``with``
block) kills and reaps them, and the same happens when the pool is garbage-collected or the
interpreter exits. Workers also die with their parent on Linux (``PR_SET_PDEATHSIG``) and
exit when their stdin closes, so none outlives the trainer. (The death signal follows the
thread that started a process, so workers are started from one long-lived thread rather
than from whichever thread called the pool.) A used pool can be used again
after :meth:`~VerifierPool.close`; it starts new workers. POSIX only.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import json
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from strop.errors import BackendUnavailableError

logger = logging.getLogger(__name__)

_WORKER_SCRIPT = str(Path(__file__).with_name("_verify_worker.py"))
_HEADER = struct.Struct(">I")
_MAX_START_FAILURES = 3


class Verdict(enum.Enum):
    """What the pool says about one ``(gold, answer)`` pair."""

    EQUAL = "equal"
    NOT_EQUAL = "not_equal"
    TIMEOUT = "timeout"  # the check exceeded the deadline; its worker was killed
    ERROR = "error"  # math-verify raised, or the worker died mid-item


@dataclass(frozen=True)
class PoolStats:
    """Cumulative counters of a :class:`VerifierPool`.

    Attributes:
      items: pairs checked.
      timeouts: pairs that exceeded the deadline (their worker was killed).
      errors: pairs on which math-verify raised or the worker died.
      restarts: workers started to replace a killed or dead one.
    """

    items: int = 0
    timeouts: int = 0
    errors: int = 0
    restarts: int = 0


class _Worker:
    """One child process and the parent's end of its pipes."""

    def __init__(self, proc: subprocess.Popen, now: float):
        self.proc = proc
        assert proc.stdout is not None and proc.stdin is not None
        self.fd = proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = bytearray()
        self.started = now
        self.ready = False
        self.item: int | None = None  # index of the pair it is checking
        self.since = 0.0  # when it was handed that pair

    def send(self, message: dict) -> None:
        data = json.dumps(message).encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        self.proc.stdin.flush()

    def receive(self) -> list[dict] | None:
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
            messages.append(json.loads(self.buffer[_HEADER.size : _HEADER.size + size]))
            del self.buffer[: _HEADER.size + size]
        if eof and not messages:
            return None
        return messages


def _kill(proc: subprocess.Popen) -> None:
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


class _Spawner:
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


_spawner = _Spawner()


def _kill_all(procs: set[subprocess.Popen], owner_pid: int) -> None:
    # A forked child inherits this finalizer; the workers belong to its parent, not to it.
    if os.getpid() != owner_pid:
        return
    while procs:
        _kill(procs.pop())


class VerifierPool:
    """Killable math-verify worker processes with a per-item deadline.

    Args:
      workers: number of worker processes (each is single-threaded).
      deadline_s: longest one ``(gold, answer)`` check may run before its worker is killed
        and the check counts as :attr:`Verdict.TIMEOUT`.
      max_memory_bytes: address-space limit (``RLIMIT_AS``) set in each worker after it has
        loaded math-verify, so a runaway expression fails with ``MemoryError`` instead of
        swapping the machine; ``None`` for no limit.
      start_timeout_s: longest a worker may take to load math-verify before it is replaced.

    Thread-safe: concurrent :meth:`verify_many` calls run one after the other.
    """

    def __init__(
        self,
        workers: int = 2,
        deadline_s: float = 5.0,
        *,
        max_memory_bytes: int | None = 4 << 30,
        start_timeout_s: float = 60.0,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.workers = workers
        self.deadline_s = float(deadline_s)
        self.max_memory_bytes = max_memory_bytes
        self.start_timeout_s = float(start_timeout_s)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._stats = PoolStats()
        self._start_failures = 0
        self._adopt_process()

    def _adopt_process(self) -> None:
        """(Re)initialise the per-process state: the worker set and its exit-time cleanup."""
        self._owner_pid = os.getpid()
        self._procs: set[subprocess.Popen] = set()
        self._workers = []
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, self._owner_pid)

    def __repr__(self) -> str:
        return (
            f"VerifierPool(workers={self.workers}, deadline_s={self.deadline_s}, "
            f"running={len(self._workers)})"
        )

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def stats(self) -> PoolStats:
        """A snapshot of the counters since the pool was made."""
        return self._stats

    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (for diagnostics and tests)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Kill and reap every worker. Idempotent; the pool restarts if used again."""
        self._check_process()
        with self._lock:
            self._close_locked()

    def _check_process(self) -> None:
        """In a forked child, forget the parent's workers (they are not ours to use or kill)
        and its lock (another parent thread may have held it at the fork)."""
        if os.getpid() != self._owner_pid:
            self._lock = threading.Lock()
            self._adopt_process()

    def _close_locked(self) -> None:
        for worker in self._workers:
            self._procs.discard(worker.proc)
            _kill(worker.proc)
        self._workers = []
        self._start_failures = 0

    def verify(self, gold: str, answer: str) -> Verdict:
        """Check one pair; see :meth:`verify_many`."""
        return self.verify_many([(gold, answer)])[0]

    def verify_many(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        """``verify(parse(gold), parse(answer))`` for each pair, in parallel on the workers.

        Each pair gets at most ``deadline_s`` of a worker's time once it is handed to one, so
        a batch takes at most about ``len(pairs) / workers * deadline_s`` (plus start-up).

        Raises:
          BackendUnavailableError: math-verify is not installed, or workers keep dying
            before they are ready. (Per-pair failures do not raise; they are verdicts.)
        """
        if not pairs:
            return []
        self._check_process()
        with self._lock:
            try:
                return self._run(pairs)
            except BaseException:
                # Interrupted (or broken): workers may hold items of this batch; start afresh.
                self._close_locked()
                raise

    def _spawn(self) -> _Worker:
        env = dict(os.environ)
        env["STROP_VERIFY_PARENT_PID"] = str(os.getpid())
        env["STROP_VERIFY_MAX_MEMORY"] = str(self.max_memory_bytes or 0)
        proc = _spawner.popen(
            [sys.executable, "-P", _WORKER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            # Own session: a Ctrl-C in the terminal interrupts the trainer, not its workers.
            start_new_session=True,
        )
        self._procs.add(proc)
        return _Worker(proc, time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        self._procs.discard(worker.proc)
        _kill(worker.proc)
        self._workers[self._workers.index(worker)] = self._spawn()
        self._stats = replace(self._stats, restarts=self._stats.restarts + 1)

    def _start_failed(self, worker: _Worker, why: str) -> None:
        self._start_failures += 1
        if self._start_failures >= _MAX_START_FAILURES:
            raise BackendUnavailableError(
                f"math-verify workers failed to start {self._start_failures} times in a row "
                f"(last: {why}); their stderr, above, says why"
            )
        logger.warning("verifier worker %d failed to start (%s); retrying", worker.proc.pid, why)
        self._replace(worker)

    def _finish(self, worker: _Worker, verdicts: list[Verdict | None], verdict: Verdict) -> None:
        assert worker.item is not None
        verdicts[worker.item] = verdict
        worker.item = None
        s = self._stats
        self._stats = replace(
            s,
            items=s.items + 1,
            timeouts=s.timeouts + (verdict is Verdict.TIMEOUT),
            errors=s.errors + (verdict is Verdict.ERROR),
        )

    def _run(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        if not self._workers:
            if importlib.util.find_spec("math_verify") is None:
                raise BackendUnavailableError(
                    "the math rewards need math-verify: pip install 'math-verify>=0.9'"
                )
            self._workers = [self._spawn() for _ in range(self.workers)]
        verdicts: list[Verdict | None] = [None] * len(pairs)
        queue = deque(range(len(pairs)))
        while queue or any(w.item is not None for w in self._workers):
            now = time.monotonic()
            for worker in list(self._workers):
                if not (queue and worker.ready and worker.item is None):
                    continue
                if worker.proc.poll() is not None:  # died while idle: not the item's fault
                    self._replace(worker)
                    continue
                index = queue.popleft()
                gold, answer = pairs[index]
                worker.item, worker.since = index, now
                try:
                    worker.send({"id": index, "gold": str(gold), "answer": str(answer)})
                except OSError as exc:
                    logger.debug("verifier worker %d: send failed: %r", worker.proc.pid, exc)
                    self._finish(worker, verdicts, Verdict.ERROR)
                    self._replace(worker)

            waits = [
                (w.since + self.deadline_s)
                if w.item is not None
                else (w.started + self.start_timeout_s)
                for w in self._workers
                if w.item is not None or not w.ready
            ]
            if not waits:
                continue
            timeout = max(0.0, min(waits) - time.monotonic())
            readable, _, _ = select.select([w.fd for w in self._workers], [], [], timeout)

            for worker in [w for w in self._workers if w.fd in readable]:
                messages = worker.receive()
                if messages is None:  # the worker exited
                    code = worker.proc.wait()
                    if worker.item is not None:
                        logger.debug("verifier worker died (exit %s) on item %d", code, worker.item)
                        self._finish(worker, verdicts, Verdict.ERROR)
                        self._replace(worker)
                    elif not worker.ready:
                        self._start_failed(worker, f"exit code {code}")
                    else:
                        self._replace(worker)
                    continue
                for message in messages:
                    if "ready" in message:
                        worker.ready = True
                        self._start_failures = 0
                    elif "fatal" in message:
                        raise BackendUnavailableError(
                            f"math-verify cannot be loaded in the reward worker "
                            f"({message['fatal']}); pip install 'math-verify>=0.9'"
                        )
                    elif worker.item is not None and message.get("id") == worker.item:
                        if "error" in message:
                            logger.debug("math-verify failed: %s", message["error"])
                            self._finish(worker, verdicts, Verdict.ERROR)
                        else:
                            equal = bool(message.get("equal"))
                            self._finish(
                                worker, verdicts, Verdict.EQUAL if equal else Verdict.NOT_EQUAL
                            )
                    else:  # cannot happen with this worker script; never trust the pipe blindly
                        logger.warning("verifier worker sent an unexpected message: %r", message)
                        if worker.item is not None:
                            self._finish(worker, verdicts, Verdict.ERROR)
                        self._replace(worker)
                        break

            now = time.monotonic()
            for worker in list(self._workers):
                if worker.item is not None and now - worker.since >= self.deadline_s:
                    logger.debug(
                        "verifier item %d exceeded %.1f s; killing worker %d",
                        worker.item,
                        self.deadline_s,
                        worker.proc.pid,
                    )
                    self._finish(worker, verdicts, Verdict.TIMEOUT)
                    self._replace(worker)
                elif not worker.ready and now - worker.started >= self.start_timeout_s:
                    self._start_failed(worker, f"not ready after {self.start_timeout_s:.0f} s")
        assert all(v is not None for v in verdicts)
        return verdicts  # type: ignore[return-value]


_default_pool: VerifierPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> VerifierPool:
    """The process-wide pool the built-in math rewards use (made on first call, started on
    first use, closed at interpreter exit)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = VerifierPool()
        return _default_pool
