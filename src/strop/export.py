"""``strop export``: a run's latest checkpoint as a PEFT adapter or a merged HF model.

Works on SFT runs (the policy) and PPO runs (the actor; the critic and value head stay
in the checkpoint). Which of the two a run is comes from its checkpoints' identity
(``job``), so the recipe and overrides that trained a run are all ``export`` needs; the
base model, when ``model.path`` is not given, is the one the checkpoints record.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from strop.backends import get_backend
from strop.config import Config
from strop.errors import CheckpointError
from strop.io.checkpoint_dir import refuse_other_backends_checkpoints, stored_identity
from strop.io.writable import require_writable_parent
from strop.preflight import preflight

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    """What was exported: from which job and checkpoint step, to which directory."""

    job: str
    step: int
    path: Path


def run_export(config: Config, out: str | os.PathLike, *, merged: bool) -> ExportResult:
    """Restore the newest checkpoint of ``config.run_dir`` (or ``checkpoint.dir``) and write
    the trained model to ``out``: a merged HF checkpoint, or else a PEFT adapter."""
    require_writable_parent(out, "--out")  # before anything loads
    checkpoint_dir = config.checkpoint_path()
    refuse_other_backends_checkpoints(checkpoint_dir, config.backend)  # "train first" misleads
    identity = stored_identity(checkpoint_dir, config.backend)
    if identity is None:
        raise CheckpointError(
            f"no {config.backend} checkpoint in {Path(checkpoint_dir).absolute()}; train "
            "first (or pass the run_dir / checkpoint.dir the run was trained with)"
        )
    job = str(identity.get("job", "sft"))  # SFT checkpoints predate the key
    if config.model.path is None and identity.get("base_model"):
        config = config.model_copy(
            update={"model": config.model.model_copy(update={"path": identity["base_model"]})}
        )
        logger.info("base model from the run's checkpoints: model.path=%s", config.model.path)
    preflight(config, job, checkpoint_dir)
    backend = get_backend(config.backend)
    if job == "ppo":
        engine = backend.build_actor_critic(
            config, total_updates=config.ppo.optimizer_updates(), checkpoint_dir=checkpoint_dir
        )
    else:
        engine = backend.build_policy(
            config, total_steps=config.sft.steps, checkpoint_dir=checkpoint_dir
        )
    step = engine.latest_checkpoint()
    if step is None:
        raise CheckpointError(f"no complete checkpoint in {Path(checkpoint_dir).absolute()}")
    engine.restore_checkpoint(step)
    path = engine.export_merged(out) if merged else engine.export_adapter(out)
    return ExportResult(job, step, Path(path))
