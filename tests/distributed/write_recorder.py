"""The strop CLI with every rename into its run directory recorded, per process.

``python -m tests.distributed.write_recorder LOG_DIR STROP-ARGS...`` runs ``strop
STROP-ARGS`` (one of several JAX processes or ``torchrun`` ranks) and, when the command
returns, writes ``LOG_DIR/<process>.json`` with

- ``renames``: the destinations of ``os.replace`` / ``os.rename`` inside the run directory
  (``run_dir=`` in the arguments), leaving out its ``checkpoints/``, whose writes are
  collective by design; every output strop writes appears by such a rename;
- ``at_exit``: the paths in the run directory (outside ``checkpoints/``) when the command
  returned (before the processes leave their group, which is a barrier on JAX).

Process 0 sleeps :data:`DELAY` seconds before each of those renames. The race this catches
then shows whatever the machine's load: a second process that writes an output too is in
``renames``, and one that returns without waiting for process 0's write lacks the output
in ``at_exit``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

DELAY = 1.5  # seconds process 0 waits before each rename into the run directory


def process_index() -> int:
    return int(os.environ.get("JAX_PROCESS_ID") or os.environ.get("RANK") or 0)


def main(log_dir: Path, args: list[str]) -> None:
    import strop.cli

    run_dir = next(Path(a.split("=", 1)[1]).absolute() for a in args if a.startswith("run_dir="))
    index, renames = process_index(), []

    def outside_checkpoints(path: Path) -> bool:
        return run_dir in path.parents and run_dir / "checkpoints" not in (path, *path.parents)

    def recorded(real):
        def rename(src, dst, *rest, **options):
            target = Path(os.path.abspath(dst))
            if outside_checkpoints(target):
                if index == 0:
                    time.sleep(DELAY)
                renames.append(str(target.relative_to(run_dir)))
            return real(src, dst, *rest, **options)

        return rename

    os.replace, os.rename = recorded(os.replace), recorded(os.rename)

    def record() -> None:
        log = log_dir / f"{index}.json"
        if log.exists():  # the first call tells: when the command returned
            return
        entries = sorted(
            str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if outside_checkpoints(p)
        )
        log.write_text(json.dumps({"renames": renames, "at_exit": entries}))

    # A command that succeeded returns into the process-group shutdown (a barrier of its
    # own on JAX): record before it, so that only strop's own waiting counts.
    shut_down = strop.cli.shut_down_loaded_backends

    def record_then_shut_down() -> bool:
        record()
        return shut_down()

    strop.cli.shut_down_loaded_backends = record_then_shut_down
    try:
        strop.cli.main(args)
    finally:
        record()


def assert_each_output_written_once(log_dir: Path, processes: int, outputs: list[str]) -> None:
    """Only process 0 renamed anything into the run directory, every one of ``outputs``
    (paths relative to it) among it, and each process returned with all of them in place."""
    logs = [json.loads((log_dir / f"{i}.json").read_text()) for i in range(processes)]
    for output in outputs:  # written where it stands, or in a directory renamed into place
        written = any(output == r or output.startswith(f"{r}/") for r in logs[0]["renames"])
        assert written, f"process 0 did not write {output}"
    for i, log in enumerate(logs[1:], start=1):
        assert not log["renames"], f"process {i} wrote {log['renames']} too"
    for i, log in enumerate(logs):
        missing = sorted(set(outputs) - set(log["at_exit"]))
        assert not missing, f"process {i} returned before {missing} existed"


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
