"""A user's reward function called in a worker process, under a deadline per call.

A function from ``package.module:function`` or ``path/to/file.py:function`` may hang (a
network call, an endless loop, a regex that backtracks for ever); called in the trainer it
would hold the run with nothing but "step 1 running for 10m50s" to show for it. So
:class:`IsolatedFunction` calls it in a child process (``python -P _call_worker.py``,
started as :mod:`strop.rewards.pool` starts its math-verify workers) that imports the
function itself by its reference, the way the trainer did: no pickling of the function, so
closures and anything else a module defines work. Each call sends the batch (a pickle
over a pipe; about a millisecond for a few dozen completions) and waits at most
``timeout_s`` for the answer; past that the worker's process group is SIGKILLed, a fresh
worker is started, and :class:`RewardTimeoutError` names the reward and the setting. A
worker that dies mid-call (a crash in C code, the OOM killer, ``os._exit``) fails that
call's completions; the next call starts another.

The worker starts when :meth:`IsolatedFunction.start` is called (the PPO loop and ``strop
eval`` do so before building the model, so its import overlaps theirs) or at the first
call; its start-up (importing strop's reward modules and the user's, about half a second)
is not charged to the deadline. It dies with the trainer, as the verifier workers do.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from strop.errors import StropError
from strop.rewards.calling import ContractError, Outcome, RewardError
from strop.rewards.workers import Worker, kill, spawner

_WORKER_SCRIPT = str(Path(__file__).with_name("_call_worker.py"))


class RewardTimeoutError(RewardError):
    """A reward function did not return within its per-call deadline (exit code 2)."""


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the worker's process group (what the function started too), then reap it."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    kill(proc)


def _kill_all(procs: set[subprocess.Popen], owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked child: the workers are its parent's
        return
    while procs:
        _kill(procs.pop())


def _encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class IsolatedFunction:
    """Calls the reward function ``ref`` (``/abs/path.py:fn`` or ``module:fn``) in a worker.

    Args:
      ref: the reference the worker imports (a file by its absolute path).
      timeout_s: the longest one call may take before the worker is killed.
      describe: how messages name the reward (``reward 'f' (my.py:f)``).
      setting: the deadline's setting, for messages (``ppo.reward_timeout_s``).
      start_timeout_s: the longest the worker may take to import the function.

    Calls are serialised (one worker, one call at a time). ``__call__`` returns the
    :class:`~strop.rewards.calling.Outcome` the worker sent, raises
    :class:`~strop.rewards.calling.ContractError` for a result that breaks the contract,
    the :class:`StropError` raised inside the function, :class:`RewardTimeoutError`, and
    :class:`RewardError` when the worker cannot load the function.
    """

    def __init__(
        self,
        ref: str,
        timeout_s: float,
        *,
        describe: str,
        setting: str,
        start_timeout_s: float = 120.0,
    ):
        self.ref, self.timeout_s, self.start_timeout_s = ref, float(timeout_s), start_timeout_s
        self.describe, self.setting = describe, setting
        self._lock = threading.Lock()
        self._adopt_process()

    def _adopt_process(self) -> None:
        self._owner_pid = os.getpid()
        self._procs: set[subprocess.Popen] = set()
        self._worker: Worker | None = None
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, self._owner_pid)

    def _check_process(self) -> None:
        if os.getpid() != self._owner_pid:  # forked: the parent's worker is not ours
            self._lock = threading.Lock()
            self._adopt_process()

    def start(self) -> None:
        """Start the worker now (it imports the function while the caller goes on)."""
        self._check_process()
        with self._lock:
            if self._worker is None:
                self._worker = self._spawn()

    def close(self) -> None:
        """Kill the worker; a later call starts another."""
        self._check_process()
        with self._lock:
            self._drop()

    def pid(self) -> int | None:
        """The worker's process id, if one runs (for tests)."""
        return None if self._worker is None else self._worker.proc.pid

    def _spawn(self) -> Worker:
        env = dict(os.environ, STROP_VERIFY_PARENT_PID=str(os.getpid()))
        proc = spawner.popen(
            [sys.executable, "-P", _WORKER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # Ctrl-C interrupts the trainer; _kill takes the group
        )
        self._procs.add(proc)
        worker = Worker(proc, time.monotonic(), encode=_encode, decode=pickle.loads)
        with contextlib.suppress(OSError):  # died at once: _ready reports its exit
            worker.send({"path": list(sys.path), "ref": self.ref, "setting": self.setting})
        return worker

    def _drop(self) -> None:
        if self._worker is not None:
            self._procs.discard(self._worker.proc)
            _kill(self._worker.proc)
            self._worker = None

    def __call__(self, prompts: list[str], completions: list[str], cols: dict) -> Outcome:
        self._check_process()
        with self._lock:
            try:
                reply = self._call(prompts, completions, cols)
            except RewardTimeoutError:
                self._drop()
                self._worker = self._spawn()  # ready for whoever calls next
                raise
            except BaseException:
                self._drop()  # interrupted or broken: the next call starts afresh
                raise
        return self._reply(reply)

    def _call(self, prompts: list[str], completions: list[str], cols: dict) -> tuple:
        """The worker's reply to one call: ``(kind, value)``."""
        worker = self._ready()
        try:
            data = _encode((prompts, completions, cols))
        except Exception as exc:
            raise RewardError(
                f"{self.describe}: its inputs cannot be sent to its worker process ({exc}); "
                f"set {self.setting}=0 to call it in the trainer"
            ) from None
        try:
            worker.write(data)
        except OSError:
            return self._crashed(worker)
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RewardTimeoutError(
                    f"{self.describe} did not return within {self.setting}="
                    f"{self.timeout_s:g} s on {len(completions)} completion(s); its worker "
                    f"process was killed. Make it faster, or raise {self.setting} (0: no "
                    "deadline, called in the trainer)"
                )
            select.select([worker.fd], [], [], left)
            messages = worker.receive()
            if messages is None:
                return self._crashed(worker)
            if messages:
                return messages[0]

    def _reply(self, message: tuple) -> Outcome:
        kind, value = message
        if kind == "ok":
            return value
        if kind == "contract":
            raise ContractError(value)
        if isinstance(value, StropError):
            raise value
        raise RewardError(f"{self.describe}: {value}")

    def _crashed(self, worker: Worker) -> tuple:
        self._drop()  # reaps it: its own exit code, or SIGKILL if it was still closing
        code = worker.proc.returncode
        how = f"exit code {code}"
        with contextlib.suppress(ValueError):
            how = f"signal {signal.Signals(-code).name}" if code < 0 else how
        return ("ok", Outcome(raised=f"its worker process died ({how})", crashed=True))

    def _ready(self) -> Worker:
        """The worker, started if none runs, once it has imported the function."""
        if self._worker is None:
            self._worker = self._spawn()
        worker = self._worker
        while not worker.ready:
            left = worker.started + self.start_timeout_s - time.monotonic()
            if left <= 0:
                self._fail(f"was not ready after {self.start_timeout_s:g} s")
            select.select([worker.fd], [], [], left)
            messages = worker.receive()
            if messages is None:
                self._fail(f"exited with code {worker.proc.wait()} before it was ready")
            for kind, value in messages or ():
                if kind == "fatal":
                    self._fail(f"could not import it: {value}")
                worker.ready = True
        return worker

    def _fail(self, why: str) -> None:
        self._drop()
        raise RewardError(
            f"{self.describe}: its worker process {why}; set {self.setting}=0 to call it in "
            "the trainer"
        )
