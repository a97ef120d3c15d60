"""What a run directory says about the jobs that ran in it.

Once ``strop sft`` or ``strop ppo`` (and so ``strop demo``) has accepted its job (the
checkpoint it resumes restored: a refused job changes nothing here) the main process
writes ``<run_dir>/config.yaml``, the resolved config (it is a recipe: ``strop sft
runs/x/config.yaml`` runs it again), and ``<run_dir>/versions.json``, the versions of
strop, Python and the backend's packages. When a run directory already holds a
``config.yaml`` (a resume, or a rerun), the keys that differ are listed in one warning
before the new files replace the old.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

import yaml

import strop
from strop.config import Config, dump_config
from strop.config.sources import RUN_CONFIG_FILE as CONFIG_FILE
from strop.io.atomic import write_text_atomically
from strop.io.run_identity import flatten

logger = logging.getLogger(__name__)

VERSIONS_FILE = "versions.json"
BACKEND_PACKAGES = {
    "jax": ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "qwix"),
    "torch": ("torch", "transformers", "peft"),
}
SHOWN_CHANGES = 12  # at most this many differences are spelled out in the warning


def record_run(config: Config, job: str) -> None:
    """Write ``config.yaml`` and ``versions.json`` into the run directory (one process: call
    it through the backend's ``write_once``), warning first about what changed."""
    run_dir = Path(config.run_dir)
    current = config.model_dump(mode="json")
    previous = _previous_config(run_dir / CONFIG_FILE)
    if previous is not None:
        changes = config_changes(previous, current)
        if changes:
            logger.warning(
                "run_dir %s ran before with another config (%s): %s",
                run_dir, CONFIG_FILE, "; ".join(changes),
            )  # fmt: skip
    write_text_atomically(run_dir / CONFIG_FILE, dump_config(config))
    write_text_atomically(
        run_dir / VERSIONS_FILE, json.dumps(versions(config.backend, job), indent=2)
    )


def versions(backend: str, job: str) -> dict[str, Any]:
    """strop's, Python's and the backend packages' versions, with the job and its start."""
    packages = {}
    for package in BACKEND_PACKAGES[backend]:
        try:
            packages[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            packages[package] = None
    return {
        "job": job,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "strop": strop.__version__,
        "python": platform.python_version(),
        "backend": backend,
        "packages": packages,
    }


def config_changes(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for each key whose value differs (at most :data:`SHOWN_CHANGES`,
    then how many more)."""
    old, new = flatten(previous), flatten(current)
    changes = [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]
    if len(changes) > SHOWN_CHANGES:
        changes = [*changes[:SHOWN_CHANGES], f"and {len(changes) - SHOWN_CHANGES} more"]
    return changes


def _previous_config(path: Path) -> dict[str, Any] | None:
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as err:
        logger.warning("cannot read the previous %s (%s); writing a new one", path, err)
        return None
    return loaded if isinstance(loaded, dict) else None
