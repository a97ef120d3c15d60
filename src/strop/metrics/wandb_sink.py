"""Weights & Biases as a third metrics sink (``logging.wandb=true``), next to
``metrics.jsonl`` and TensorBoard.

The W&B run is named after the run directory, carries the resolved config, and receives
the same records at the same steps. Its id is kept in ``<run_dir>/wandb-run-id``, so a
resumed strop run continues the same W&B run (W&B keeps the first value logged at a step:
steps a killed attempt logged past its checkpoint are not replaced there, unlike in
``metrics.jsonl``). ``WANDB_MODE=offline`` writes the run under ``<run_dir>/wandb`` without
a network, to be synced later with ``wandb sync``.

``wandb`` is an optional extra: :func:`require_wandb` refuses ``logging.wandb=true``
without it before anything loads.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from strop.errors import ConfigError
from strop.io.atomic import write_text_atomically

INSTALL = "pip install 'strop[wandb]'"
RUN_ID_FILE = "wandb-run-id"


def require_wandb() -> None:
    """Raise :class:`ConfigError` with the install line when ``wandb`` is not installed."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"logging.wandb=true needs the wandb package, which is not installed: {INSTALL} "
            "(or set logging.wandb=false)"
        )


class WandbSink:
    """One W&B run for one strop run directory."""

    def __init__(self, run_dir: str | Path, project: str, config: Mapping[str, Any]):
        require_wandb()
        import wandb

        run_dir = Path(run_dir).absolute()
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            write_text_atomically(id_file, run_id + "\n")
        self._run = wandb.init(
            project=project,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=dict(config),
        )

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        self._run.log(numbers, step=step)

    def close(self) -> None:
        self._run.finish()
