"""Where metrics go: ``metrics.jsonl`` in the run directory, TensorBoard event files, and
Weights & Biases (:mod:`strop.metrics.wandb_sink`) when ``logging.wandb`` is on.

Sample generations (:meth:`MetricsWriter.write_samples`: a validation's prompts,
responses, extracted answers and rewards, ``logging.samples`` of them) go to
``samples.jsonl`` (one JSON object per sample, with its step), a TensorBoard text summary
(a Markdown table) and a W&B table, under ``validation/samples``.

Metric names are ``group/name`` (``train/loss``, ``eval/loss``, ``throughput/tokens_per_s``).
One JSON object per logged step: ``{"step": 10, "train/loss": 1.23, ...}``.

A resumed run continues the same file: records past the checkpoint it resumed from (the
killed attempt's, which the resume recomputes) and a line a kill cut short are removed
first, so the file holds each step once, in order (see ``MetricsWriter(keep_through=)``).

A sink that cannot write (a full disk) raises one :class:`~strop.errors.WriteError` line
naming it, at the call that logged (:func:`strop.io.writable.writing`); while another
error stops the run, the sinks close quietly, so that error is the one reported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strop.errors import WriteError
from strop.io.writable import writing

if TYPE_CHECKING:
    from strop.config import Config
    from strop.metrics.tensorboard import TensorBoardFile

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
SAMPLES_TAG = "validation/samples"


class MetricsWriter:
    """Appends metrics to ``<run_dir>/metrics.jsonl`` and, if asked, TensorBoard logs.

    With ``enabled=False`` (every process but the first of a distributed run) it writes
    nothing.

    ``keep_through``: for a run that (re)starts after step ``keep_through`` (its resumed
    checkpoint, or ``-1`` for a fresh start), earlier records of later steps are dropped
    from ``metrics.jsonl`` and hidden in TensorBoard (``purge_step``); ``None`` appends to
    whatever is there.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        enabled: bool = True,
        keep_through: int | None = None,
        wandb: tuple[str, Mapping[str, Any]] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / SAMPLES_FILE
        self.tensorboard_dir = self.run_dir / "tensorboard"
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        with writing("metrics", self.path):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for path in (self.path, self.samples_path):
                if keep_through is not None and path.exists():
                    _drop_records_after(path, keep_through)
            # unbuffered: a write that fails leaves nothing behind to fail again at close
            self._file = self.path.open("ab", buffering=0)
        if tensorboard:
            try:
                from strop.metrics.tensorboard import TensorBoardFile
            except ImportError:  # optional: JSONL is always written
                logger.warning("tensorboardX is not installed; TensorBoard logs are off")
            else:
                purge = None if keep_through is None else keep_through + 1
                with writing("TensorBoard logs", self.tensorboard_dir):
                    self._tb = TensorBoardFile(self.tensorboard_dir, purge_step=purge)
        if wandb is not None:
            from strop.metrics.wandb_sink import WandbSink

            project, config = wandb
            self._wandb = WandbSink(self.run_dir, project, config)

    @classmethod
    def for_run(cls, config: Config, *, enabled: bool, resumed_from: int | None) -> MetricsWriter:
        """The writer of a training run: its run directory, the sinks ``logging`` asks for
        (W&B with the resolved config), and the records of a killed attempt past the
        checkpoint ``resumed_from`` dropped."""
        wandb = None
        if config.logging.wandb:
            wandb = (config.logging.wandb_project, config.model_dump(mode="json"))
        return cls(
            config.run_dir,
            tensorboard=config.logging.tensorboard,
            enabled=enabled,
            keep_through=-1 if resumed_from is None else resumed_from,
            wandb=wandb,
        )

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` at ``step`` (non-finite floats are written as null in JSON)."""
        if self._file is None:
            return
        record: dict[str, Any] = {"step": step}
        for name, value in metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                record[name] = None
            else:
                record[name] = value
        with writing("metrics", self.path):
            _append(self._file, json.dumps(record) + "\n")
        if self._tb is not None:
            scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
            self._to_board(lambda board: [board.add_scalar(k, v, step) for k, v in scalars.items()])
        if self._wandb is not None:
            self._wandb.write(step, metrics)

    def write_samples(
        self, step: int, samples: Sequence[Mapping[str, Any]], tag: str = SAMPLES_TAG
    ) -> None:
        """Record sample generations at ``step`` (records of the same keys: prompt,
        response, extracted, gold, reward) in every sink; nothing when there are none."""
        if self._file is None or not samples:
            return
        with writing("samples", self.samples_path), self.samples_path.open("ab", buffering=0) as f:
            _append(f, "".join(json.dumps({"step": step, **s}) + "\n" for s in samples))
        if self._tb is not None:
            self._to_board(lambda board: board.add_text(tag, markdown_table(samples), step))
        if self._wandb is not None:
            self._wandb.write_table(step, tag, samples)

    def _to_board(self, log: Callable[[TensorBoardFile], object]) -> None:
        """``log`` to TensorBoard, flushed; a failure is raised once: the event file, whose
        buffer still holds what failed, is then closed quietly and logs nothing more."""
        try:
            with writing("TensorBoard logs", self.tensorboard_dir):
                log(self._tb)
                self._tb.flush()
        except WriteError:
            board, self._tb = self._tb, None
            with contextlib.suppress(OSError):  # the same failure, reported above
                board.close()
            raise

    def close(self) -> None:
        """Close every sink; the first that fails raises its :class:`WriteError` once the
        others are closed too."""
        failures = []
        for close in self._closers():
            try:
                close()
            except Exception as err:  # each sink is closed whatever the others did
                failures.append(err)
        if failures:
            raise failures[0]

    def _closers(self) -> list:
        closers = []
        if self._file is not None:
            closers.append(self._file.close)
        if self._tb is not None:
            closers.append(_named(self._tb.close, "TensorBoard logs", self.tensorboard_dir))
        if self._wandb is not None:
            closers.append(self._wandb.close)
        self._file = self._tb = self._wandb = None
        return closers

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # another error stops the run: it is the one to report
            self.close()
        except Exception as err:
            logger.debug("closing the metrics sinks after the run failed: %s", err)


def _append(file: Any, text: str) -> None:
    """Write ``text`` to the unbuffered binary ``file``: all of it, or raise (a full disk
    writes part, then fails)."""
    data = memoryview(text.encode("utf-8"))
    while data:
        data = data[file.write(data) :]


def _named(close: Any, what: str, path: Path) -> Any:
    def closing() -> None:
        with writing(what, path):
            close()

    return closing


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` as a Markdown table (TensorBoard's text plugin renders it), a column per
    key of the first row; ``|`` escaped and newlines as ``<br>`` inside cells."""
    columns = list(rows[0])

    def cell(value: Any) -> str:
        text = "" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without records of steps after ``step`` and without a
    last line a kill cut short; say what was dropped."""
    lines = path.read_bytes().split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    kept, dropped = [], 0
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # not ours to judge: keep what we cannot read
            kept.append(line)
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and (record["step"] > step)
        ):
            dropped += 1
        else:
            kept.append(line)
    if not dropped and not torn:
        return
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_bytes(b"".join(line + b"\n" for line in kept))
    os.replace(staging, path)
    logger.info(
        "%s: dropped %d record(s) after step %d%s (the resume recomputes them)",
        path, dropped, step, " and a torn last line" if torn else "",
    )  # fmt: skip
