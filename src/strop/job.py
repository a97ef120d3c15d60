"""What a training command (``strop sft``, ``strop ppo``) holds for its whole life, after
its preflight: the run directory (:func:`~strop.preflight.holding_run_dir`), its progress
report (:class:`~strop.progress.RunProgress`) and the Ctrl-C / SIGTERM report that names
the checkpoint to resume from (:func:`~strop.interrupts.reporting_interrupts`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from strop.config import Config
from strop.interrupts import reporting_interrupts
from strop.preflight import holding_run_dir
from strop.progress import RunProgress, is_main_by_environment


@contextmanager
def training_job(
    config: Config, job: str, steps: int, figures: Mapping[str, str]
) -> Iterator[RunProgress]:
    """Hold ``config.run_dir`` for ``job`` (``"sft"``, ``"ppo"``) of ``steps`` steps and
    yield its progress report, which shows ``figures`` (see :class:`RunProgress`)."""
    progress = RunProgress(job, steps, figures, enabled=is_main_by_environment())

    def step_running() -> int:
        return progress.completed + 1

    with (
        holding_run_dir(config, job),
        progress,
        reporting_interrupts(step_running, config.checkpoint_path(), config.backend),
    ):
        yield progress
