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
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strop.config import Config

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
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.samples_path):
            if keep_through is not None and path.exists():
                _drop_records_after(path, keep_through)
        self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # optional: JSONL is always written
                logger.warning("tensorboardX is not installed; TensorBoard logs are off")
            else:
                purge = None if keep_through is None else keep_through + 1
                self._tb = SummaryWriter(logdir=str(self.run_dir / "tensorboard"), purge_step=purge)
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
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in metrics.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.write(step, metrics)

    def write_samples(
        self, step: int, samples: Sequence[Mapping[str, Any]], tag: str = SAMPLES_TAG
    ) -> None:
        """Record sample generations at ``step`` (records of the same keys: prompt,
        response, extracted, gold, reward) in every sink; nothing when there are none."""
        if self._file is None or not samples:
            return
        with self.samples_path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps({"step": step, **s}) + "\n" for s in samples))
        if self._tb is not None:
            self._tb.add_text(tag, markdown_table(samples), step)
        if self._wandb is not None:
            self._wandb.write_table(step, tag, samples)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
