"""A run's checkpoint directory, backend-neutral: which backend wrote it, and the one
message a failed save gives on every backend.

Each backend keeps its own format (Orbax, DCP) under ``<checkpoint dir>/<step>/``; what
they share (refusing the other's directory, reporting a failed save with the free
space, :class:`StepCheckpoints`) lives here so the two stay alike.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from strop.errors import CheckpointError, ConfigError
from strop.io.checksums import checksum_problem
from strop.io.writable import free_space

# Where each backend keeps a checkpoint's identity, relative to the step's directory
# (``<checkpoint dir>/<step>/``): Orbax's JsonSave item, DCP checkpoints' plain file.
IDENTITY_FILES = {"jax": Path("identity") / "metadata", "torch": Path("identity.json")}
# What a save cut short leaves in the checkpoint directory: Orbax's temporary step
# directories, and the staging directory a DCP save writes before its rename.
UNFINISHED_SAVES = {"jax": "*.orbax-checkpoint-tmp*", "torch": ".tmp-*"}


def remove_unfinished_saves(directory: str | os.PathLike, backend: str | None = None) -> None:
    """Delete what saves killed or interrupted half-way left in ``directory`` (of
    ``backend``, or of either). Complete steps are never touched."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for name, pattern in UNFINISHED_SAVES.items():
        if backend in (None, name):
            for leftover in directory.glob(pattern):
                shutil.rmtree(leftover, ignore_errors=True)


Listing = dict[str, list[int]]
"""The steps each backend has written to a checkpoint directory
(:func:`backends_with_checkpoints`)."""


def backends_with_checkpoints(directory: str | os.PathLike) -> Listing:
    """The steps each backend has written to ``directory``, judged by where the step keeps
    its identity (complete or not: a foreign half-written step is not ours to clean)."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    found: dict[str, list[int]] = {}
    for entry in sorted(directory.iterdir(), key=lambda e: (len(e.name), e.name)):
        if not entry.name.isdigit():
            continue
        for backend, identity in IDENTITY_FILES.items():
            if (entry / identity).is_file():
                found.setdefault(backend, []).append(int(entry.name))
    return found


def stored_identity(directory: str | os.PathLike, backend: str) -> dict | None:
    """The identity (:func:`~strop.io.run_identity.run_identity` plus ``job``) stored with
    ``backend``'s newest checkpoint in ``directory``; ``None`` when there is none.

    Every step of a run directory has the same identity (a resume with another one is
    refused), so the newest step with a readable identity speaks for the run.
    """
    newest = newest_identity(directory, backend)
    return None if newest is None else newest[1]


def newest_identity(
    directory: str | os.PathLike, backend: str, listing: Listing | None = None
) -> tuple[int, dict] | None:
    """``(step, identity)`` of ``backend``'s newest checkpoint in ``directory`` with a
    readable identity (read as JSON, no backend needed); ``None`` when there is none.
    ``listing``: :func:`backends_with_checkpoints` of ``directory``, if read already."""
    if listing is None:
        listing = backends_with_checkpoints(directory)
    for step in reversed(listing.get(backend, [])):
        path = Path(directory) / str(step) / IDENTITY_FILES[backend]
        try:
            identity = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a step cut short by a kill; an older one will do
        if isinstance(identity, dict):
            return step, identity
    return None


def stored_job(directory: str | os.PathLike, backend: str) -> str | None:
    """The job (``"sft"``, ``"ppo"`` or ``"dpo"``) that wrote ``backend``'s newest checkpoint in
    ``directory``; ``None`` when there is no checkpoint."""
    identity = stored_identity(directory, backend)
    return None if identity is None else str(identity.get("job", "sft"))  # SFT predates it


def refuse_other_backends_checkpoints(
    directory: str | os.PathLike, backend: str, listing: Listing | None = None
) -> None:
    """Raise :class:`CheckpointError` if another backend wrote checkpoints to ``directory``.

    The backends store checkpoints in their own formats (Orbax, DCP) and do not convert
    between them, so resuming there with ``backend`` would either fail on files it cannot
    read or silently start over next to the other run's steps. Cheap (a directory
    listing), so it runs before any model loads; ``listing``: that listing, if read already.
    """
    if listing is None:
        listing = backends_with_checkpoints(directory)
    for other, steps in listing.items():
        if other != backend:
            listed = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
            raise CheckpointError(
                f"{Path(directory).absolute()} holds checkpoints the {other} backend wrote "
                f"(steps {listed}) and this run uses backend={backend}; checkpoints are not "
                f"converted between backends. Resume with backend={other}, or start this "
                "run in a new run directory."
            )


def save_failed(step: int, directory: Path, reason: str, previous: int | None) -> CheckpointError:
    """The error for a save of ``step`` that failed with ``reason`` (one line), naming the
    intact ``previous`` checkpoint (``None``: none was written yet) and the free space
    where the save went."""
    kept = (
        "no checkpoint was written yet"
        if previous is None
        else f"the previous checkpoint ({previous}) is intact"
    )
    return CheckpointError(
        f"saving checkpoint step {step} to {directory} failed: {reason}; {kept}. Check free "
        f"space{free_space(directory)} and permissions of the run directory."
    )


def require_step(step: int, directory: Path, steps: list[int]) -> None:
    """Raise :class:`CheckpointError` unless ``step`` is one of the complete ``steps`` in
    ``directory``."""
    if step not in steps:
        raise CheckpointError(
            f"no complete checkpoint for step {step} in {directory} (available: {steps or 'none'})"
        )


def require_intact(step: int, directory: Path, steps: list[int]) -> None:
    """Raise one :class:`CheckpointError` line if a file of checkpoint ``step`` in
    ``directory`` no longer matches its checksums, naming the newest older step of
    ``steps`` that does (verified too, only then) and how to resume from it.

    A damaged step is refused rather than skipped: falling back on its own would quietly
    discard the steps (and metrics) after the intact one, and deleting files is the
    user's call."""
    problem = checksum_problem(directory / str(step))
    if problem is None:
        return
    older = [s for s in steps if s < step]
    intact = next(
        (s for s in reversed(older) if checksum_problem(directory / str(s)) is None), None
    )
    damaged = f"checkpoint step {step} in {directory} is damaged ({problem})"
    if intact is None:
        raise CheckpointError(
            f"{damaged} and no earlier checkpoint is intact; delete {directory} to start the "
            "run over"
        )
    doomed = [s for s in steps if intact < s <= step]
    where = (
        str(directory / str(step))
        if doomed == [step]
        else f"steps {', '.join(map(str, doomed))} in {directory}"
    )
    raise CheckpointError(
        f"{damaged}; step {intact} is intact: delete {where} to resume from step {intact}"
    )


class StepCheckpoints:
    """What both backends' ``TrainCheckpoints`` share: one run's checkpoints in
    ``directory`` (one sub-directory per step; another backend's directory is refused),
    each stored with the run's ``identity``, the last ``keep`` kept. A backend's subclass
    stores and reads the steps in its format and lists them (:meth:`all_steps`);
    ``write_once`` is its ``write_once`` (the one process that verifies checksums)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        identity: Mapping[str, Any],
        keep: int,
        *,
        backend: str,
        write_once: Callable[[Callable[[], object], str], None],
    ) -> None:
        if keep < 1:
            raise CheckpointError(f"checkpoint keep must be at least 1, got {keep}")
        self.directory = Path(directory).absolute()
        self.identity = dict(identity)
        self.keep = keep
        self._write_once = write_once
        refuse_other_backends_checkpoints(self.directory, backend)

    def all_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        raise NotImplementedError

    def _new_step(self, step: int, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """``extra`` as a dict, for a save of ``step``: one :class:`CheckpointError` line
        when it is not JSON-serialisable or ``step`` is saved already."""
        extra = dict(extra or {})
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint extra is not JSON-serialisable: {err}") from None
        if step in self.all_steps():
            raise CheckpointError(
                f"checkpoint step {step} already exists in {self.directory}; resume from it "
                "or use a new run directory"
            )
        return extra

    def _require(self, step: int) -> None:
        require_step(step, self.directory, self.all_steps())

    def _verify(self, step: int) -> None:
        """Raise one :class:`CheckpointError` line unless ``step`` is complete and its files
        still match their checksums (:func:`require_intact`: one process reads them, every
        process gets the verdict)."""
        self._require(step)
        self._write_once(
            lambda: require_intact(step, self.directory, self.all_steps()),
            f"verifying checkpoint step {step}",
        )


def short_reason(text: str, limit: int = 200) -> str:
    """``text`` on one line of at most ``limit`` characters (a library's error can be a
    page: a traceback per rank, a TensorStore spec)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def refuse_step_past_the_end(
    step: int, total: int, run_dir: str, *, steps_key: str, step_word: str = "step"
) -> None:
    """Raise :class:`ConfigError` if checkpoint ``step`` is past the run's ``total`` steps
    (``steps_key``'s value: ``sft.steps``, ``ppo.steps``...; one is a ``step_word``):
    there is nothing to train, and resuming would report a run of those steps that is not
    one (and drop the records past them from ``metrics.jsonl``)."""
    if step > total:
        key, what = steps_key, step_word
        raise ConfigError(
            f"run_dir {run_dir} already holds checkpoint {what} {step}, past "
            f"{key}={total}: nothing to train; raise {key} to continue the run, export it "
            f"with `strop export {run_dir} --adapter --out DIR`, or give another "
            "run_dir for a new run"
        )
