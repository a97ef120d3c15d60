"""Progress of a long command (``sft``, ``ppo``, ``eval``, ``demo``), with or without a terminal.

On a terminal, a rich progress bar. Otherwise (CI, ``nohup``, output sent to a file) a bar
draws nothing useful, so a plain log line is written instead, once the first step is done
and then at most every ``interval`` seconds as steps end, with the step, the command's
own figures (loss, reward, ...), seconds per step and the time left::

    12:01:15 INFO strop.run.progress: ppo 12/60 | reward 0.412 | val acc 55.0% | 3.10 s/step | ETA 2m29s

Seconds per step and the ETA count the steps after the first, which carries the compiles
and warm-up (the bar's own estimate leaves it out too); the line after the first step
gives its time alone (``step 1 took 57.1 s; ETA after step 2``).

While a step or a phase (loading the model, the first compile, validation) runs with
nothing said, a line names what is running: after ``first_line`` seconds (1 s) for the
first line of the command, then every ``interval`` seconds::

    12:01:30 INFO strop.run.progress: ppo 12/60 | step 13 running for 15s

so that the command speaks within seconds and is never silent for more than about
``interval`` seconds. A phase is not announced the moment it begins: a command that
fails at once (on bad data, say) prints its one error line and nothing else. Only the
main process of a run of several reports (``enabled``).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Mapping
from types import TracebackType

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

logger = logging.getLogger(__name__)

PLAIN_INTERVAL_S = 10.0  # a plain line at least this often while a command works
FIRST_LINE_S = 1.0  # what runs is named once it has run this long, if nothing was said yet


def on_terminal() -> bool:
    """Whether stdout is an interactive terminal (a progress bar can be drawn)."""
    return sys.stdout.isatty()


def is_main_by_environment() -> bool:
    """Whether this process is the first of its run by the launcher's variables (torchrun's
    ``RANK``, ``JAX_PROCESS_ID``): known before any backend starts."""
    return all(
        os.environ.get(name, "0").strip() in ("", "0") for name in ("RANK", "JAX_PROCESS_ID")
    )


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class RunProgress:
    """Reports ``name``'s progress through ``total`` steps.

    Args:
      name: the command (``"ppo"``).
      total: steps in the whole run.
      figures: how each figure given to :meth:`update` is shown, e.g.
        ``{"loss": "loss {:.4f}"}``; a figure not yet known is left out.
      completed: steps already done (a resumed run).
      enabled: whether this process reports (the main process of a run).
      terminal: draw a bar (default: when stdout is a terminal), else plain lines.
      interval: seconds between plain lines.
      first_line: seconds a phase or step runs before the command's first plain line
        names it (at most ``interval``).
    """

    def __init__(
        self,
        name: str,
        total: int,
        figures: Mapping[str, str],
        *,
        completed: int = 0,
        enabled: bool = True,
        terminal: bool | None = None,
        interval: float = PLAIN_INTERVAL_S,
        first_line: float = FIRST_LINE_S,
    ):
        self.name, self.total, self.figures = name, total, dict(figures)
        self.enabled = enabled
        self.terminal = on_terminal() if terminal is None else terminal
        self.interval = interval
        self.first_line = min(first_line, interval)
        self._said_anything = False
        self._started_at = completed
        self._completed = completed
        self._values: dict[str, float] = {}
        self._phase = ""
        self._lock = threading.Lock()
        self._began = self._phase_began = self._said_at = time.monotonic()
        self._step_began = self._began  # the last update(), or phase("") before a step
        self._first_step_done_at: float | None = None
        self._first_step_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Progress | None = None
        self._task = None

    @property
    def completed(self) -> int:
        """Steps done so far (in this run and the ones it resumed)."""
        return self._completed

    def set_total(self, total: int) -> None:
        """The number of steps, once known (``eval``: after the data is read)."""
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def resumed_at(self, completed: int) -> None:
        """The run resumes with ``completed`` steps already done."""
        with self._lock:
            self._started_at = self._completed = completed
        if self._bar is not None:
            self._bar.update(self._task, completed=completed)

    # -- what a loop calls -----------------------------------------------------------------

    def phase(self, text: str) -> None:
        """Say what runs now (``"loading the model"``, ``"validating"``); shown on the bar,
        and in the plain lines while it lasts."""
        with self._lock:
            self._phase, self._phase_began = text, time.monotonic()
            if not text:
                self._step_began = self._phase_began
        if self._bar is not None:
            self._bar.update(self._task, description=self._description())

    def update(self, completed: int, **values: float) -> None:
        """``completed`` steps are done; ``values`` are the latest figures."""
        now = time.monotonic()
        with self._lock:
            if self._first_step_done_at is None and completed > self._started_at:
                self._first_step_done_at, self._first_completed = now, completed
                self._first_step_seconds = now - self._step_began
            self._completed = completed
            self._values.update(values)
            self._phase, self._phase_began = "", now
            self._step_began = now
            first = self._first_step_done_at == now  # the first step of this run is done
            due = self.enabled and not self.terminal
            due = due and (first or now - self._said_at >= self.interval or completed >= self.total)
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, description=self._description(),
                             figures=self._figures())  # fmt: skip
        if due:
            self._say(self._line(now))

    # -- plumbing ---------------------------------------------------------------------------

    def __enter__(self) -> RunProgress:
        if not self.enabled:
            return self
        if self.terminal:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[figures]}"),
                TimeRemainingColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(
                self._description(), total=self.total, completed=self._completed, figures=""
            )
        else:
            self._thread = threading.Thread(target=self._watch, name="strop-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.__exit__(kind, error, trace)

    def _watch(self) -> None:
        """Say what is running when nothing was said for ``interval`` seconds."""
        while not self._stop.wait(min(0.5, max(self.first_line / 4, 0.05))):
            now = time.monotonic()
            with self._lock:
                quiet = now - self._said_at >= self.interval or (
                    not self._said_anything and now - self._phase_began >= self.first_line
                )
                running = self._phase or (
                    f"step {self._completed + 1}" if self._completed < self.total else ""
                )
                began = self._phase_began
            quiet = quiet and bool(running)
            if quiet:
                self._say(f"{self._head()} | {running} running for {_duration(now - began)}")

    def _say(self, line: str) -> None:
        with self._lock:
            self._said_at, self._said_anything = time.monotonic(), True
        if self.enabled:
            logger.info("%s", line)

    def _description(self) -> str:
        return f"{self.name} ({self._phase})" if self._phase else self.name

    def _head(self) -> str:
        return f"{self.name} {self._completed}/{self.total}"

    def _figures(self) -> str:
        shown = []
        for key, form in self.figures.items():
            value = self._values.get(key)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                shown.append(form.format(value))
        return " | ".join(shown)

    def _line(self, now: float) -> str:
        parts = [self._head()]
        if self._figures():
            parts.append(self._figures())
        rate = self._seconds_per_step(now)
        if rate is not None:
            parts.append(f"{rate:.2f} s/step")
            parts.append(f"ETA {_duration(rate * (self.total - self._completed))}")
        elif self._first_step_done_at is not None and self._completed < self.total:
            first = self._first_completed
            parts.append(
                f"step {first} took {self._first_step_seconds:.1f} s; ETA after step {first + 1}"
            )
        return " | ".join(parts)

    def _seconds_per_step(self, now: float) -> float | None:
        """Seconds per step since the first step ended: the first carries the compiles
        and warm-up (loading the model is before it); None until a second step is done."""
        if self._first_step_done_at is None:
            return None
        steps = self._completed - self._first_completed
        return (now - self._first_step_done_at) / steps if steps > 0 else None
