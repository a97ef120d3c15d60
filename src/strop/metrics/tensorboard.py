"""A run's TensorBoard event file, written in the caller's thread.

tensorboardX's ``SummaryWriter`` hands every event to a thread of its own, which writes
and flushes it later: on a full disk that thread dies with a traceback of its own, its
bounded queue then blocks the next logging call (the run hangs), and whatever it had
buffered fails again at ``close`` (an ``OSError`` traceback over the run's own error).
:class:`TensorBoardFile` builds the same events with tensorboardX's summary functions and
writes them through its synchronous ``EventsWriter`` (the file and record format
TensorBoard reads), flushing once per logged step: a failure is the logging call's own
exception, raised where strop can name it.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.summary import scalar, text


class TensorBoardFile:
    """Scalars and text summaries in one new event file under ``logdir``.

    ``purge_step``: events of this step and later that earlier files of ``logdir`` hold
    are hidden (a resumed run recomputes them), as ``SummaryWriter(purge_step=)`` does.
    """

    def __init__(self, logdir: str | os.PathLike, *, purge_step: int | None = None):
        Path(logdir).mkdir(parents=True, exist_ok=True)
        # named events.out.tfevents.<seconds>.<host>.<random>: without the last part, a
        # run resumed within the second it stopped would overwrite the earlier file
        self._events = EventsWriter(
            os.path.join(logdir, "events"), filename_suffix=f".{uuid.uuid4().hex[:8]}"
        )
        if purge_step is not None:
            self._write(Event(step=purge_step, file_version="brain.Event:2"))
            self._write(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._write(Event(step=step, summary=scalar(tag, value)))

    def add_text(self, tag: str, markdown: str, step: int) -> None:
        self._write(Event(step=step, summary=text(tag, markdown)))

    def flush(self) -> None:
        """Write what is buffered to disk (fsync'd, as tensorboardX's own flush)."""
        self._events.flush()

    def close(self) -> None:
        self._events.close()

    def _write(self, event: Event) -> None:
        event.wall_time = time.time()
        self._events.write_event(event)
