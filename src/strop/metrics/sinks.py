"""Where metrics go: ``metrics.jsonl`` in the run directory, and TensorBoard event files.

Metric names are ``group/name`` (``train/loss``, ``eval/loss``, ``throughput/tokens_per_s``).
One JSON object per logged step: ``{"step": 10, "train/loss": 1.23, ...}``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends metrics to ``<run_dir>/metrics.jsonl`` and, if asked, TensorBoard logs.

    With ``enabled=False`` (every process but the first of a distributed run) it writes
    nothing.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # optional: JSONL is always written
                logger.warning("tensorboardX is not installed; TensorBoard logs are off")
            else:
                self._tb = SummaryWriter(logdir=str(self.run_dir / "tensorboard"))

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

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` file, in order."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
