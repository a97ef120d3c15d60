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
after :meth:`~VerifierPool.close`; it starts new workers. POSIX only. (The parent's end of
one worker, and the thread that starts them, are in :mod:`strop.rewards.workers`.)
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from strop.errors import BackendUnavailableError
from strop.rewards.workers import Worker, kill, spawner

logger = logging.getLogger(__name__)

_WORKER_SCRIPT = str(Path(__file__).with_name("_verify_worker.py"))
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


def _kill_all(procs: set[subprocess.Popen], owner_pid: int) -> None:
    # A forked child inherits this finalizer; the workers belong to its parent, not to it.
    if os.getpid() != owner_pid:
        return
    while procs:
        kill(procs.pop())


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
        self._workers: list[Worker] = []
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
            kill(worker.proc)
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

    def _spawn(self) -> Worker:
        env = dict(os.environ)
        env["STROP_VERIFY_PARENT_PID"] = str(os.getpid())
        env["STROP_VERIFY_MAX_MEMORY"] = str(self.max_memory_bytes or 0)
        proc = spawner.popen(
            [sys.executable, "-P", _WORKER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            # Own session: a Ctrl-C in the terminal interrupts the trainer, not its workers.
            start_new_session=True,
        )
        self._procs.add(proc)
        return Worker(proc, time.monotonic())

    def _replace(self, worker: Worker) -> None:
        self._procs.discard(worker.proc)
        kill(worker.proc)
        self._workers[self._workers.index(worker)] = self._spawn()
        self._stats = replace(self._stats, restarts=self._stats.restarts + 1)

    def _start_failed(self, worker: Worker, why: str) -> None:
        self._start_failures += 1
        if self._start_failures >= _MAX_START_FAILURES:
            raise BackendUnavailableError(
                f"math-verify workers failed to start {self._start_failures} times in a row "
                f"(last: {why}); their stderr, above, says why"
            )
        logger.warning("verifier worker %d failed to start (%s); retrying", worker.proc.pid, why)
        self._replace(worker)

    def _finish(self, worker: Worker, verdicts: list[Verdict | None], verdict: Verdict) -> None:
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
        self._start_workers()
        verdicts: list[Verdict | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        while pending or any(w.item is not None for w in self._workers):
            self._hand_out(pairs, pending, verdicts)
            readable = self._wait()
            self._collect(readable, verdicts)
            self._expire(verdicts)
        assert all(v is not None for v in verdicts)
        return verdicts  # type: ignore[return-value]

    def _start_workers(self) -> None:
        """Start the workers if none run (on first use, and after :meth:`close`)."""
        if not self._workers:
            if importlib.util.find_spec("math_verify") is None:
                raise BackendUnavailableError(
                    "the math rewards need math-verify: pip install 'math-verify>=0.9'"
                )
            self._workers = [self._spawn() for _ in range(self.workers)]

    def _hand_out(
        self,
        pairs: Sequence[tuple[str, str]],
        pending: deque[int],
        verdicts: list[Verdict | None],
    ) -> None:
        """Give the next pending pair to each ready, idle worker; its deadline starts now."""
        now = time.monotonic()
        for worker in list(self._workers):
            if not (pending and worker.ready and worker.item is None):
                continue
            if worker.proc.poll() is not None:  # died while idle: not the item's fault
                self._replace(worker)
                continue
            index = pending.popleft()
            gold, answer = pairs[index]
            worker.item, worker.since = index, now
            try:
                worker.send({"id": index, "gold": str(gold), "answer": str(answer)})
            except OSError as exc:
                logger.debug("verifier worker %d: send failed: %r", worker.proc.pid, exc)
                self._finish(worker, verdicts, Verdict.ERROR)
                self._replace(worker)

    def _wait(self) -> list[int]:
        """Block until a worker has output or the nearest deadline (an item's, or a start-up's)
        passes; the file descriptors that can be read. At once, with none, when every worker
        is ready and idle."""
        waits = [
            (w.since + self.deadline_s)
            if w.item is not None
            else (w.started + self.start_timeout_s)
            for w in self._workers
            if w.item is not None or not w.ready
        ]
        if not waits:
            return []
        timeout = max(0.0, min(waits) - time.monotonic())
        readable, _, _ = select.select([w.fd for w in self._workers], [], [], timeout)
        return readable

    def _collect(self, readable: list[int], verdicts: list[Verdict | None]) -> None:
        """Read the workers with output: readiness, verdicts and exits."""
        for worker in [w for w in self._workers if w.fd in readable]:
            messages = worker.receive()
            if messages is None:
                self._exited(worker, verdicts)
                continue
            for message in messages:
                if not self._on_message(worker, message, verdicts):
                    break

    def _exited(self, worker: Worker, verdicts: list[Verdict | None]) -> None:
        """``worker`` closed its stdout: reap it and start another."""
        code = worker.proc.wait()
        if worker.item is not None:
            logger.debug("verifier worker died (exit %s) on item %d", code, worker.item)
            self._finish(worker, verdicts, Verdict.ERROR)
            self._replace(worker)
        elif not worker.ready:
            self._start_failed(worker, f"exit code {code}")
        else:
            self._replace(worker)

    def _on_message(self, worker: Worker, message: dict, verdicts: list[Verdict | None]) -> bool:
        """Act on one message from ``worker``; ``False`` once it has been replaced."""
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
                self._finish(worker, verdicts, Verdict.EQUAL if equal else Verdict.NOT_EQUAL)
        else:  # cannot happen with this worker script; never trust the pipe blindly
            logger.warning("verifier worker sent an unexpected message: %r", message)
            if worker.item is not None:
                self._finish(worker, verdicts, Verdict.ERROR)
            self._replace(worker)
            return False
        return True

    def _expire(self, verdicts: list[Verdict | None]) -> None:
        """Kill and replace the workers past their deadline: an item's (a
        :attr:`Verdict.TIMEOUT`) or start-up's."""
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
