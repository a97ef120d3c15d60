"""``strop export``: a run's latest checkpoint as a PEFT adapter or a merged HF model.

Works on SFT runs (the policy) and PPO runs (the actor; the critic and value head stay
in the checkpoint). Which of the two a run is comes from its checkpoints' identity
(``job``). What else the export needs (the base model, the LoRA shape, whether the run
had a critic) comes from the ``config.yaml`` the run wrote (:func:`export_config`): the
run directory alone is enough, ``strop export runs/x --adapter --out DIR``; a recipe
(with overrides) names the run through its ``run_dir``, and overrides still apply on top
of the run's own config. The base model, when ``model.path`` is not given at all, is the
one the checkpoints record.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from strop.config import Config, load_config
from strop.errors import CheckpointError, ConfigError
from strop.io.checkpoint_dir import (
    backends_with_checkpoints,
    refuse_other_backends_checkpoints,
    stored_identity,
)
from strop.io.run_record import CONFIG_FILE
from strop.io.writable import require_output_dir
from strop.lora_targets import match_targets
from strop.models import ModelSpec
from strop.run.job import build_trained_model
from strop.run.kinds import run_kind
from strop.run.preflight import preflight

logger = logging.getLogger(__name__)

USAGE = "strop export RUN_DIR --adapter --out DIR"
EXPORT_ADVICE = (
    "Export with the settings it was trained with: name the run directory alone "
    f"({USAGE}; its {CONFIG_FILE} holds them), or leave out the overrides that differ."
)
SHOWN_RUNS = 5  # at most this many run directories are named when the asked one has none


@dataclass(frozen=True)
class ExportResult:
    """What was exported: from which job and checkpoint step, to which directory."""

    job: str
    step: int
    path: Path
    merged: bool  # a merged HF checkpoint, else a PEFT adapter


def export_config(run: str, overrides: Sequence[str] = ()) -> Config:
    """The config of the run ``strop export RUN [OVERRIDES]`` names, ``overrides`` on top.

    ``run`` is the run directory (its ``config.yaml``), or a recipe (a file or built-in
    name; ``demo`` means the demo's ``runs/demo-<backend>``) whose ``run_dir`` holds the
    run: its ``config.yaml``, where there is one, replaces the recipe. ``strop export
    run_dir=runs/x`` (an override in the recipe's place) names the directory too.
    """
    overrides = list(overrides)
    if "=" in run and not Path(run).exists():  # `strop export run_dir=runs/x ...`
        named = [o.partition("=")[2].strip() for o in [run, *overrides] if _key(o) == "run_dir"]
        if not named:
            raise ConfigError(
                f"strop export {run}: name the run to export, by its directory ({USAGE}) "
                "or by the recipe it was trained with (strop export RECIPE [OVERRIDES] ...)"
            )
        return _recorded(Path(named[-1]), [run, *overrides])
    if Path(run).is_dir():
        return _recorded(Path(run), overrides)
    if run == "demo":
        from strop.commands.demo import demo_recipe, with_backend_run_dir

        overrides = with_backend_run_dir(overrides)
        run = demo_recipe(overrides)  # demo-calc with env.name=calculator
    config = load_config(run, overrides)
    recorded = Path(config.run_dir) / CONFIG_FILE
    if not recorded.is_file():
        return config  # a run older than config.yaml, or none yet: run_export says which
    logger.info("the run's config: %s%s", recorded, " with the overrides given" * bool(overrides))
    return load_config(recorded, [*overrides, f"run_dir={config.run_dir}"])


def _key(override: str) -> str:
    return override.partition("=")[0].strip()


def _recorded(run_dir: Path, overrides: list[str]) -> Config:
    """The config ``run_dir`` recorded when its run started, ``overrides`` on top."""
    recorded = run_dir / CONFIG_FILE
    if not recorded.is_file():
        raise ConfigError(
            f"{run_dir} holds no {CONFIG_FILE} (strop sft and strop ppo write one when a run "
            "starts): name the recipe and overrides it was trained with instead, strop export "
            f"RECIPE [OVERRIDES] run_dir={run_dir} --adapter --out DIR"
        )
    return load_config(run_dir, overrides)  # config.yaml with run_dir the directory


def refuse_merging_a_tied_head(config: Config, spec: ModelSpec) -> None:
    """A LoRA adapter on ``lm_head`` of a model whose head is its embedding table
    (``tie_word_embeddings``: Gemma 3, SmolLM3, Qwen2.5-0.5B...) has no merged form that
    keeps the tie: merged into the shared table it would change the embeddings too, and
    written once it would be dropped. Refused in one line before anything loads."""
    targets = match_targets(config.lora.target_modules, spec.linear_paths())
    if spec.tie_word_embeddings and "lm_head" in targets:
        raise ConfigError(
            "--merged: the adapter on lm_head cannot merge into this model's tied "
            "embeddings (tie_word_embeddings=true in its config.json); export the adapter "
            "(strop export RUN_DIR --adapter), or train without lm_head in "
            "lora.target_modules"
        )


def run_export(config: Config, out: str | os.PathLike, *, merged: bool | None) -> ExportResult:
    """Restore the newest checkpoint of ``config.run_dir`` (or ``checkpoint.dir``) and write
    the trained model to ``out``: a merged HF checkpoint, or else a PEFT adapter;
    ``merged=None``: what the run trained (with LoRA the adapter, else the model)."""
    require_output_dir(out, "--out")  # before anything loads
    if merged is None:
        merged = not config.lora.enabled
    checkpoint_dir = config.checkpoint_path()
    refuse_other_backends_checkpoints(checkpoint_dir, config.backend)  # "train first" misleads
    identity = stored_identity(checkpoint_dir, config.backend)
    if identity is None:
        raise CheckpointError(
            f"no {config.backend} checkpoint in {Path(checkpoint_dir).absolute()}; train "
            f"first, or name the run to export: {USAGE}{_runs_beside(Path(config.run_dir))}"
        )
    kind = run_kind(str(identity.get("job", "sft")))  # SFT checkpoints predate the key
    if config.model.path is None and identity.get("base_model"):
        config = config.model_copy(
            update={"model": config.model.model_copy(update={"path": identity["base_model"]})}
        )
        logger.info("base model from the run's checkpoints: model.path=%s", config.model.path)
    facts = preflight(
        config, kind, checkpoint_dir=checkpoint_dir, advice=EXPORT_ADVICE, exporting=True
    )
    if merged and config.lora.enabled:
        refuse_merging_a_tied_head(config, facts.model_spec(config))
    engine = build_trained_model(config, facts)  # as the run built it
    step = engine.latest_checkpoint()
    if step is None:
        raise CheckpointError(f"no complete checkpoint in {Path(checkpoint_dir).absolute()}")
    engine.restore_checkpoint(step)
    path = engine.export_merged(out) if merged else engine.export_adapter(out)
    return ExportResult(kind.name, step, Path(path), merged)


def _runs_beside(run_dir: Path) -> str:
    """`` (run directories beside it with checkpoints: ...)``, or nothing if there are none."""
    try:
        beside = sorted(d for d in run_dir.parent.iterdir() if d.is_dir() and d != run_dir)
    except OSError:
        return ""
    runs = [str(d) for d in beside if backends_with_checkpoints(d / "checkpoints")]
    if not runs:
        return ""
    more = f", and {len(runs) - SHOWN_RUNS} more" if len(runs) > SHOWN_RUNS else ""
    return f" (run directories beside it with checkpoints: {', '.join(runs[:SHOWN_RUNS])}{more})"
