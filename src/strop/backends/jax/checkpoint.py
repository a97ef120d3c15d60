"""Training checkpoints on Orbax: trainable params, optimizer state, loop state, identity.

A checkpoint holds exactly what a resumed run cannot rebuild from its config:

- ``params``: the trainable part of the model (the one trainable filter, invariant 1), so
  with LoRA on only the adapters are stored, never the base weights;
- ``optimizer``: ``nnx.state(optimizer)`` (optax moments and counters plus the step;
  in Flax 0.12 the optimizer no longer references the model, so no params ride along);
- ``extra``: JSON the loop wants back (data position, RNG state, ...);
- ``identity``: JSON naming the base model, the LoRA shape and the backend, checked on
  restore so a checkpoint is never loaded into a model it does not belong to.

Orbax writes each step under a temporary name and renames it when complete (invariant
11): a step killed half-way is never listed, and leftovers are removed when a run opens
the directory again. Saves are blocking, so a returned ``save`` is on disk.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from strop.errors import CheckpointError
from strop.io.run_identity import flatten, identity_differences

logger = logging.getLogger(__name__)

ITEMS = ("params", "optimizer", "extra", "identity")


def _abstract(tree: Any) -> Any:
    """Shape/dtype/sharding targets so restored arrays land where the live ones are."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class TrainCheckpoints:
    """The checkpoints of one run, in ``directory`` (e.g. ``<run_dir>/checkpoints``).

    Args:
      directory: created if missing; one sub-directory per saved step.
      identity: what this run is (see :func:`run_identity`); stored with every step and
        compared on restore.
      keep: how many of the most recent checkpoints to keep (older ones are deleted).
    """

    def __init__(self, directory: str | os.PathLike, identity: Mapping[str, Any], keep: int = 3):
        if keep < 1:
            raise CheckpointError(f"checkpoint keep must be at least 1, got {keep}")
        self.directory = Path(directory).absolute()
        self.identity = dict(identity)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,  # remove steps a killed run left half-written
            enable_async_checkpointing=False,
        )
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        except OSError as err:
            raise CheckpointError(
                f"cannot use checkpoint directory {self.directory}: {err}; choose a writable "
                "run directory"
            ) from None

    def all_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` when there is none."""
        return self._manager.latest_step()

    def save(
        self,
        step: int,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        trainable: nnx.filterlib.Filter,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Write checkpoint ``step`` and return once it is complete on disk.

        Stores ``nnx.state(model, trainable)``, ``nnx.state(optimizer)``, ``extra`` (must
        be JSON-serialisable) and the identity. On failure raises :class:`CheckpointError`;
        earlier checkpoints are untouched and nothing half-written becomes visible.
        """
        extra = dict(extra or {})
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint extra is not JSON-serialisable: {err}") from None
        if step in self._manager.all_steps():
            raise CheckpointError(
                f"checkpoint step {step} already exists in {self.directory}; resume from it "
                "or use a new run directory"
            )
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model, trainable))),
            optimizer=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(optimizer))),
            extra=ocp.args.JsonSave(extra),
            identity=ocp.args.JsonSave(self.identity),
        )
        try:
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()
        except Exception as err:  # orbax surfaces I/O failures as assorted types
            self._manager.reload()  # forget the failed step; re-read what is on disk
            raise CheckpointError(
                f"saving checkpoint step {step} to {self.directory} failed: {err!r}; the "
                f"previous checkpoint ({self.latest_step()}) is intact. Check free space and "
                "permissions of the run directory."
            ) from err
        logger.info("saved checkpoint step %d to %s", step, self.directory)

    def check_identity(self, step: int) -> None:
        """Raise :class:`CheckpointError` if checkpoint ``step`` belongs to another run."""
        self._require(step)
        stored = self._manager.restore(
            step, args=ocp.args.Composite(identity=ocp.args.JsonRestore())
        ).identity
        if stored.get("base_model") != self.identity.get("base_model"):
            logger.info(
                "checkpoint base model path %s differs from %s",
                stored.get("base_model"),
                self.identity.get("base_model"),
            )
        diffs = identity_differences(stored, self.identity)
        if diffs:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} was written by a different run: "
                + "; ".join(diffs)
                + ". Resume with the base model and LoRA settings it was written with, or "
                "start this run in a new run directory."
            )

    def restore(
        self,
        step: int,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        trainable: nnx.filterlib.Filter,
    ) -> dict[str, Any]:
        """Load checkpoint ``step`` into the live ``model`` and ``optimizer``; return ``extra``.

        Arrays are restored with the shardings of the current ones, so the jitted train
        step does not recompile. The identity is checked before any array is read.
        """
        self.check_identity(step)
        params_state = nnx.state(model, trainable)
        optim_state = nnx.state(optimizer)
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(params_state))),
            optimizer=ocp.args.StandardRestore(_abstract(nnx.to_pure_dict(optim_state))),
            extra=ocp.args.JsonRestore(),
        )
        try:
            restored = self._manager.restore(step, args=args)
            nnx.replace_by_pure_dict(params_state, restored.params)
            nnx.replace_by_pure_dict(optim_state, restored.optimizer)
        except Exception as err:  # structure/shape mismatch or unreadable files
            raise CheckpointError(
                f"cannot restore checkpoint {self.directory / str(step)}: {err}"
            ) from err
        nnx.update(model, params_state)
        nnx.update(optimizer, optim_state)
        logger.info("restored checkpoint step %d from %s", step, self.directory)
        return dict(restored.extra or {})

    def stored_params(self, step: int) -> list[str]:
        """Dotted paths of the parameter arrays stored in checkpoint ``step``."""
        self._require(step)
        metadata = self._manager.item_metadata(step).params
        return sorted(flatten(metadata.tree))

    def _require(self, step: int) -> None:
        steps = self.all_steps()
        if step not in steps:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.directory} "
                f"(available: {steps or 'none'})"
            )

    def close(self) -> None:
        """Wait for pending work and release the manager's resources."""
        self._manager.close()
