"""After a failed JAX save, the writes Orbax never started do not warn after the error line.

CI saw ``sys:1: RuntimeWarning: coroutine 'async_serialize_from_host.<locals>.write_fragment'
was never awaited`` printed at interpreter exit, after `strop`'s one-line error, once in
three runs (the file-size-limit case of test_kill_resume). A warnings filter does not
reach that late in the exit once flax, qwix or torch are imported; closing the
coroutines does.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import torch, flax.nnx
from strop.backends.jax import orbax_noise

def async_serialize_from_host():
    async def write_fragment():
        pass
    return write_fragment()

async def unrelated():
    pass

pending = [async_serialize_from_host()]
orbax_noise.quiet_unawaited_writes()  # what a failed save calls
pending += [async_serialize_from_host(), unrelated()]  # stragglers made later, and others
print("error: the one line", file=sys.stderr)
"""


def test_unstarted_writes_are_closed_and_other_coroutines_still_warn():
    done = subprocess.run(
        [sys.executable, "-c", "import sys\n" + CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "write_fragment" not in done.stderr, done.stderr
    assert "coroutine 'unrelated' was never awaited" in done.stderr  # not hidden wholesale


def test_a_late_writer_threads_error_naming_the_checkpoint_is_kept_to_debug(tmp_path, caplog):
    """A failed save's second writer thread can log its failure (absl, ERROR, with a
    traceback) after the save raised and ``orbax_errors_quiet`` ended: once a save or
    restore touched a directory, such records naming it go to DEBUG; others still show."""
    import logging

    from strop.backends.jax import orbax_noise

    directory = tmp_path / "checkpoints"
    absl = logging.getLogger("absl")
    with orbax_noise.orbax_errors_quiet(directory):
        pass
    caplog.set_level(logging.DEBUG, logger=orbax_noise.__name__)  # whatever strop's logging
    try:
        raise ValueError(f'Failed writing: "{directory}/4.orbax-checkpoint-tmp/d/x": too large')
    except ValueError:
        absl.exception("_SignalingThread.run() raised an exception")
    try:
        raise ValueError("something else entirely")
    except ValueError:
        absl.exception("another failure")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["another failure"]
    assert any("other writer failed too" in r.getMessage() for r in caplog.records)
