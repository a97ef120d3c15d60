"""The worker process that calls a user's reward function for :mod:`strop.rewards.isolated`.

Run as a script (``python -P _call_worker.py``), never imported. It talks to the trainer
over its stdin and stdout with frames of a 4-byte big-endian length and a pickle:

* trainer -> worker, first: ``{"path": sys.path, "ref": "/abs/file.py:fn"}``; the worker
  takes the trainer's ``sys.path`` and imports the function as the trainer did
  (:func:`strop.rewards.loading.load`);
* worker -> trainer, once: ``("ready", pid)``, or ``("fatal", message)`` and exit;
* trainer -> worker, per call: ``(prompts, completions, columns)``;
* worker -> trainer, per call: ``("ok", Outcome)``, ``("contract", text)`` (the result
  breaks the contract) or ``("strop", exception or text)`` (a StropError raised inside).

Anything the function prints goes to stderr (the protocol owns stdout). The worker ignores
SIGINT (the trainer reports a Ctrl-C), exits when its stdin closes, and dies with the
trainer on Linux.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys

_HEADER = struct.Struct(">I")


def _send(out, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(data)) + data)


def _receive(inp) -> object | None:
    header = inp.read(_HEADER.size)
    if header is None or len(header) != _HEADER.size:
        return None
    size = _HEADER.unpack(header)[0]
    body = inp.read(size)
    return None if body is None or len(body) != size else pickle.loads(body)


def main() -> int:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init = _receive(inp)
    if init is None:
        return 0
    sys.path[:] = init["path"]
    try:
        from strop.rewards._verify_worker import _die_with_parent

        _die_with_parent()
        from strop.errors import StropError
        from strop.rewards.calling import ContractError, Outcome, call, one_line
        from strop.rewards.loading import load

        fn = load(init["ref"], setting=init.get("setting", "reward")).fn
    except BaseException as exc:
        _send(out, ("fatal", f"{type(exc).__name__}: {exc}"))
        return 1
    _send(out, ("ready", os.getpid()))
    while True:
        request = _receive(inp)
        if request is None:
            return 0
        prompts, completions, columns = request
        try:
            reply = ("ok", call(fn, prompts, completions, columns))
        except ContractError as exc:
            reply = ("contract", str(exc))
        except StropError as exc:
            try:
                reply = ("strop", pickle.loads(pickle.dumps(exc)))
            except Exception:
                reply = ("strop", str(exc))
        except BaseException as exc:  # SystemExit, or an exception __str__ raised
            reply = ("ok", Outcome(raised=one_line(exc)))
        _send(out, reply)


if __name__ == "__main__":
    sys.exit(main())
