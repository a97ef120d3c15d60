"""What a training checkpoint belongs to, and how two such identities differ.

Backend-neutral: every backend stores :func:`run_identity` with each checkpoint and
refuses to restore one whose identity differs in anything but informational keys, so a
checkpoint is never loaded into a model (or a backend) it does not belong to.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from strop.config import Config, LoraConfig
from strop.errors import CheckpointError
from strop.objectives.roles import RolePlan

T = TypeVar("T")

# Identity keys recorded for the reader but not required to match (a base model moved
# to another path, or mounted elsewhere on another machine, is still the same model).
INFORMATIONAL_KEYS = frozenset({"base_model"})
_FINGERPRINT_BYTES = 1 << 20


def _weights_fingerprint(model_dir: Path) -> str:
    """sha256 over each safetensors file's name, size, first and last MiB (cheap, not full)."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(size - _FINGERPRINT_BYTES, 0))
            digest.update(f.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()


def model_fingerprint(
    model_dir: str | os.PathLike, *, config: str | None = "config.json", what: str = "base model"
) -> dict[str, str]:
    """A model directory's identity: the sha256 of its ``config`` file (None: it has none,
    an adapter directory) and a fingerprint of its safetensors files; a
    :class:`CheckpointError` naming ``what`` when they cannot be read."""
    model_dir = Path(model_dir).resolve()
    try:
        config_sha = (
            "" if config is None else hashlib.sha256((model_dir / config).read_bytes()).hexdigest()
        )
        weights_sha = _weights_fingerprint(model_dir)
    except OSError as err:
        raise CheckpointError(f"cannot identify {what} {model_dir}: {err}") from None
    return {"config_sha256": config_sha, "weights_fingerprint": weights_sha}


def run_identity(model_path: str | os.PathLike, lora: LoraConfig, backend: str) -> dict[str, Any]:
    """What a checkpoint belongs to: the base model, the LoRA shape and the backend.

    The base is identified by the sha256 of its ``config.json`` and a fingerprint of its
    weight files; its absolute path is recorded for messages only.
    """
    model_dir = Path(model_path).resolve()
    fingerprint = model_fingerprint(model_dir)
    config_sha, weights_sha = fingerprint["config_sha256"], fingerprint["weights_fingerprint"]
    adapter: dict[str, Any] = {"enabled": lora.enabled}
    if lora.enabled:
        adapter |= {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.target_modules)}
        if lora.base_quantization != "none":  # adapters trained over a quantized base
            adapter["base_quantization"] = lora.base_quantization
    return {
        "backend": backend,
        "base_model": str(model_dir),
        "base_config_sha256": config_sha,
        "base_weights_fingerprint": weights_sha,
        "lora": adapter,
    }


def job_identity(
    config: Config,
    backend: str,
    *,
    job: str | None = None,
    roles: RolePlan | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What ``config``'s checkpoints on ``backend`` belong to: :func:`run_identity`, plus
    the ``job`` that wrote them (None for SFT, whose checkpoints predate the key) and what
    :meth:`RolePlan.identity` records of the run's ``roles`` (a critic-free run:
    ``critic: false``; a critic on the actor's adapters: ``critic: shared_trunk``; an own
    critic: nothing, as checkpoints were before either existed), and what the kind of run
    adds (``extra``: a distillation's teacher)."""
    identity = run_identity(config.model_path(), config.lora, backend)
    if job is not None:
        identity["job"] = job
    if roles is not None:
        identity |= roles.identity()
    return identity | dict(extra or {})


@dataclass(frozen=True)
class CheckpointPlace:
    """Where a run keeps its checkpoints (``directory``), what they belong to
    (``identity``: :func:`job_identity`, derived once, at preflight) and how many it keeps
    (``checkpoint.keep``)."""

    directory: Path
    identity: Mapping[str, Any]
    keep: int

    @classmethod
    def of(
        cls,
        config: Config,
        *,
        job: str | None = None,
        roles: RolePlan | None = None,
        extra: Mapping[str, Any] | None = None,
        directory: str | os.PathLike | None = None,
    ) -> CheckpointPlace:
        """``config``'s checkpoints of ``job`` with ``roles`` and ``extra``
        (:func:`job_identity`) in ``directory`` (default :meth:`Config.checkpoint_path`)."""
        identity = job_identity(config, config.backend, job=job, roles=roles, extra=extra)
        where = Path(directory) if directory is not None else config.checkpoint_path()
        return cls(where, identity, config.checkpoint.keep)

    def open(self, kind: Callable[..., T], *args: Any) -> T:
        """A backend's checkpoints here (``kind``: its ``TrainCheckpoints``, given ``args``
        after the identity)."""
        return kind(self.directory, dict(self.identity), *args, keep=self.keep)


@dataclass(frozen=True)
class PolicyRun:
    """What a run asks of the policy it builds (``Backend.build_policy``): a learning-rate
    schedule spanning ``total_steps``, and its ``checkpoints`` (``None``: none are kept).
    The default, :data:`INFERENCE`, serves eval and benchmarks: one step, no checkpoints."""

    total_steps: int = 1
    checkpoints: CheckpointPlace | None = None


INFERENCE = PolicyRun()  # a policy built to sample or score: one step, no checkpoints


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def identity_differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two identities (empty when they match). Another
    job's checkpoints (``strop sft`` on a DPO run) are that one difference."""
    old, new = flatten(stored), flatten(json.loads(json.dumps(current)))
    jobs = (old.get("job", "sft"), new.get("job", "sft"))  # SFT's identity has no job
    if jobs[0] != jobs[1]:
        return [f"it is a strop {jobs[0]} run's and this is strop {jobs[1]}"]
    base = (old.get("base_model"), new.get("base_model"))
    diffs = []
    for key in sorted(set(old) | set(new)):
        if key in INFORMATIONAL_KEYS or old.get(key) == new.get(key):
            continue
        if key.startswith("base_"):
            what = "config.json" if "config" in key else "weights"
            diffs.append(f"base model {what} differ (checkpoint: {base[0]}, now: {base[1]})")
        else:
            diffs.append(f"{key} is {old.get(key)!r} in the checkpoint but {new.get(key)!r} now")
    return list(dict.fromkeys(diffs))


RESUME_ADVICE = (
    "Resume with the base model, LoRA settings and backend it was written with, or start "
    "this run in a new run directory."
)


def check_same_run(
    checkpoint: str | os.PathLike,
    stored: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    advice: str = RESUME_ADVICE,
) -> None:
    """Raise :class:`CheckpointError` if the identity ``stored`` with ``checkpoint`` (a
    directory) is not the run's ``current`` one, naming each difference, then ``advice``."""
    diffs = identity_differences(stored, current)
    stored_job = stored.get("job", "sft")
    if stored_job != current.get("job", "sft"):
        advice = f"Resume it with strop {stored_job}, or start this run in a new run directory."
    if diffs:
        raise CheckpointError(
            f"checkpoint {checkpoint} was written by a different run: "
            + "; ".join(diffs)
            + f". {advice}"
        )


def check_checkpoint(
    place: CheckpointPlace,
    newest: tuple[int, Mapping[str, Any]] | None,
    *,
    advice: str = RESUME_ADVICE,
) -> None:
    """Refuse (:class:`CheckpointError`) a checkpoint directory whose ``newest`` checkpoint
    (``(step, stored identity)``, :func:`~strop.io.checkpoint_dir.newest_identity`) another
    run wrote (another base model, LoRA shape, job or critic: against ``place``'s
    identity): the check the backend repeats on restore, made before anything loads or is
    written."""
    if newest is not None:
        step, stored = newest
        check_same_run(place.directory / str(step), stored, place.identity, advice=advice)
