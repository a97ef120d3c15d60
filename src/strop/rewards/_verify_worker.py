"""One math-verify worker process of :class:`strop.rewards.pool.VerifierPool`.

Run as a script (``python -P _verify_worker.py``), never imported: it needs nothing from
strop, only the standard library and ``math_verify``. It talks to the pool over its stdin and
stdout with frames of a 4-byte big-endian length followed by a UTF-8 JSON object:

* worker -> pool, once after start-up: ``{"ready": pid}``, or ``{"fatal": message}`` (and
  exit) when math-verify cannot be imported;
* pool -> worker, per item: ``{"id": int, "gold": str, "answer": str}``;
* worker -> pool, per item: ``{"id": int, "equal": bool}`` or ``{"id": int, "error": str}``.

math-verify runs with its own SIGALRM timeouts disabled: the pool enforces the deadline by
killing this process. The worker exits when its stdin closes, and (on Linux) when the
process that started it dies, so a hung verification cannot outlive the trainer.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys

_HEADER = struct.Struct(">I")


def _send(out, message: dict) -> None:
    data = json.dumps(message).encode()
    out.write(_HEADER.pack(len(data)) + data)


def _read_exactly(inp, n: int) -> bytes | None:
    data = inp.read(n)
    return data if data is not None and len(data) == n else None


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that started it goes away."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        return
    if os.getppid() != int(os.environ.get("STROP_VERIFY_PARENT_PID", os.getppid())):
        os._exit(0)  # the parent died before prctl took effect


def _limit_memory() -> None:
    limit = int(os.environ.get("STROP_VERIFY_MAX_MEMORY", "0"))
    if limit <= 0:
        return
    try:
        import resource

        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):
        pass


def main() -> int:
    # The protocol owns the original stdout; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    # Ctrl-C reaches the whole process group: the trainer reports it and stops; this
    # worker ends with it (stdin closes, or the death signal) without a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        import logging

        logging.disable(logging.CRITICAL)  # math-verify logs every unparsable answer
        from math_verify import parse, verify

        # Pay the lazy imports (sympy, the LaTeX grammar) before the first deadline starts.
        warm = parse("\\boxed{1}", parsing_timeout=None)
        verify(warm, parse("$1$", parsing_timeout=None), timeout_seconds=None)
    except BaseException as exc:
        _send(out, {"fatal": f"{type(exc).__name__}: {exc}"})
        return 1
    _limit_memory()
    _send(out, {"ready": os.getpid()})

    while True:
        header = _read_exactly(inp, _HEADER.size)
        if header is None:
            return 0
        body = _read_exactly(inp, _HEADER.unpack(header)[0])
        if body is None:
            return 0
        request = json.loads(body)
        try:
            gold = parse(request["gold"], parsing_timeout=None)
            answer = parse(request["answer"], parsing_timeout=None)
            reply = {"id": request["id"], "equal": bool(verify(gold, answer, timeout_seconds=None))}
        except Exception as exc:  # includes MemoryError and RecursionError
            reply = {"id": request["id"], "error": f"{type(exc).__name__}: {exc}"[:500]}
        _send(out, reply)


if __name__ == "__main__":
    sys.exit(main())
