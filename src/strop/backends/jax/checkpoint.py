"""Training checkpoints on Orbax: trainable params, optimizer state, loop state, identity.

A checkpoint holds exactly what a resumed run cannot rebuild from its config:

- ``params``: the trainable part of the model (the one trainable filter, invariant 1), so
  with LoRA on only the adapters are stored, never the base weights (PPO: one such tree
  per role);
- ``optimizer``: the optax state of those params (moments and counters: the schedule's
  clock), SFT's and PPO's alike (:mod:`strop.backends.jax.train`);
- ``extra``: JSON the loop wants back (data position, RNG state, ...);
- ``identity``: JSON naming the base model, the LoRA shape and the backend, checked on
  restore so a checkpoint is never loaded into a model it does not belong to.

Orbax writes each step under a temporary name and renames it when complete (invariant
11): a step killed half-way is never listed, and leftovers are removed when a run opens
the directory again. Saves are blocking, so a returned ``save`` is on disk. Just before
that rename the main process records every file's sha256 (``checksums.json``,
:mod:`strop.io.checksums`), and a restore compares them before Orbax reads an array: a
damaged step is one line naming it and the newest intact one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from strop.backends.jax.orbax_noise import orbax_errors_quiet, quiet_unawaited_writes
from strop.backends.jax.sharding import write_once
from strop.errors import CheckpointError, NonFiniteStateError
from strop.io.checkpoint_dir import (
    StepCheckpoints,
    remove_unfinished_saves,
    save_failed,
    short_reason,
)
from strop.io.checksums import write_checksums
from strop.io.run_identity import check_same_run, flatten

logger = logging.getLogger(__name__)

ITEMS = ("params", "optimizer", "extra", "identity")
# The step's own files Orbax still writes while it renames the step (the commit timestamp,
# the commit marker): not checksummed, they hold no state.
_ORBAX_STEP_FILES = ("_CHECKPOINT_METADATA", ocp.path.atomicity.COMMIT_SUCCESS_FILE)


class _ChecksummedStep(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's temporary step directory, renamed into place as usual, after the main
    process (the only one finalizing) has written the checksums of its final files."""

    async def finalize(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.to_thread(write_checksums, Path(self.get()), _ORBAX_STEP_FILES)
        await super().finalize(*args, **kwargs)


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


def _paths(tree: Any) -> tuple[list[tuple[str, ...]], list[Any], Any]:
    """Path names, leaves and structure of ``tree``, an ``nnx.Variable`` counting as one
    leaf (so a parameter is stored under its own path, as ``nnx.to_pure_dict`` names it)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)
    paths = [tuple(_key_name(k) for k in path) for path, _ in leaves]
    return paths, [leaf for _, leaf in leaves], treedef


def to_pure(tree: Any) -> dict:
    """Any pytree (``nnx.State``, optax states, dicts of them) as nested plain dicts of its
    arrays, keyed by the path names, which is what Orbax stores."""
    pure: dict = {}
    for path, leaf in zip(*_paths(tree)[:2], strict=True):
        node = pure
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = leaf.get_value() if _is_variable(leaf) else leaf
    return pure


def from_pure(like: Any, pure: dict) -> Any:
    """The inverse of :func:`to_pure`: ``pure``'s arrays in the structure of ``like``."""
    paths, like_leaves, treedef = _paths(like)
    leaves = []
    for path, like_leaf in zip(paths, like_leaves, strict=True):
        node = pure
        for name in path:
            node = node[name]
        leaves.append(like_leaf.replace(node) if _is_variable(like_leaf) else node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# The spec TensorStore appends to its errors: ``[tensorstore_spec='{...}']``, kilobytes.
_TENSORSTORE_SPEC = re.compile(r" ?\[tensorstore_spec='[^']*'\]")


def _abstract(tree: Any) -> Any:
    """Shape/dtype/sharding targets so restored arrays land where the live ones are."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _nonfinite_paths(tree: dict) -> list[str]:
    """Dotted paths of the floating-point arrays in ``tree`` holding a NaN or an Inf."""
    return [
        path
        for path, leaf in flatten(tree).items()
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) and not bool(jnp.isfinite(leaf).all())
    ]


class TrainCheckpoints(StepCheckpoints):
    """The checkpoints of one run, in ``directory`` (e.g. ``<run_dir>/checkpoints``).

    Args:
      directory: created if missing; one sub-directory per saved step.
      identity: what this run is (see :func:`run_identity`); stored with every step and
        compared on restore.
      keep: how many of the most recent checkpoints to keep (older ones are deleted).
    """

    def __init__(self, directory: str | os.PathLike, identity: Mapping[str, Any], keep: int = 3):
        super().__init__(directory, identity, keep, backend="jax", write_once=write_once)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            # Orbax would remove a killed save's leftovers in a background thread that only
            # save() waits for: a run stopping before its first save (a bad adapter, bad
            # data) exited with it still running, and it printed a traceback at interpreter
            # shutdown. So they are removed here, before the manager opens, as on torch.
            cleanup_tmp_directories=False,
            enable_async_checkpointing=False,
            temporary_path_class=_ChecksummedStep,
        )
        try:
            write_once(
                self._remove_leftovers, f"cleaning the checkpoint directory {self.directory}"
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        except OSError as err:
            raise CheckpointError(
                f"cannot use checkpoint directory {self.directory}: {err}; choose a writable "
                "run directory"
            ) from None

    def _remove_leftovers(self) -> None:
        """Delete what saves killed half-way left (one process; the others wait)."""
        remove_unfinished_saves(self.directory, "jax")

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` when there is none."""
        return self._manager.latest_step()

    def save(
        self, step: int, params: Any, optimizer: Any, extra: Mapping[str, Any] | None = None
    ) -> None:
        """Write checkpoint ``step`` and return once it is complete on disk.

        Stores the pytrees ``params`` (the trainable state: an ``nnx.State``, or a dict of
        them such as PPO's ``{"actor": ..., "critic": ...}``) and ``optimizer`` (their optax
        states, alike), ``extra`` (must be JSON-serialisable) and the identity. On failure
        raises :class:`CheckpointError`; earlier checkpoints are untouched and nothing
        half-written becomes visible.
        """
        self._save(step, to_pure(params), to_pure(optimizer), extra)

    def _save(
        self, step: int, params: dict, optimizer: dict, extra: Mapping[str, Any] | None
    ) -> None:
        extra = self._new_step(step, extra)
        poisoned = _nonfinite_paths({"params": params, "optimizer": optimizer})
        if poisoned:
            raise NonFiniteStateError(step, poisoned, self.latest_step(), str(self.directory))
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            optimizer=ocp.args.StandardSave(optimizer),
            extra=ocp.args.JsonSave(extra),
            identity=ocp.args.JsonSave(self.identity),
        )
        try:
            with orbax_errors_quiet(self.directory):
                self._manager.save(step, args=args, force=True)
                self._manager.wait_until_finished()
        except Exception as err:  # orbax surfaces I/O failures as assorted types
            quiet_unawaited_writes()
            self._manager.reload()  # forget the failed step; re-read what is on disk
            text = _TENSORSTORE_SPEC.sub("", " ".join(str(err).split()))  # a JSON page
            raise save_failed(
                step, self.directory, f"{type(err).__name__}: {text}", self.latest_step()
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
        check_same_run(self.directory / str(step), stored, self.identity)

    def restore(self, step: int, params: Any, optimizer: Any) -> tuple[Any, Any, dict]:
        """Load checkpoint ``step``: returns ``(params, optimizer, extra)`` with the
        structure and shardings of the live ``params`` and ``optimizer`` given (so a jitted
        update does not recompile). The identity is checked before any array is read."""
        pure_params, pure_optim, extra = self._restore(step, to_pure(params), to_pure(optimizer))
        return from_pure(params, pure_params), from_pure(optimizer, pure_optim), extra

    def _restore(self, step: int, params: dict, optimizer: dict) -> tuple[dict, dict, dict]:
        self._verify(step)
        self.check_identity(step)
        self._check_shapes(step, {"params": params, "optimizer": optimizer})
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params)),
            optimizer=ocp.args.StandardRestore(_abstract(optimizer)),
            extra=ocp.args.JsonRestore(),
        )
        try:
            with orbax_errors_quiet(self.directory):
                restored = self._manager.restore(step, args=args)
        except Exception as err:  # structure/shape mismatch or unreadable files
            reason = short_reason(str(err).split(" See full TensorStore details")[0])
            raise CheckpointError(
                f"cannot restore checkpoint {self.directory / str(step)}: {reason}"
            ) from err
        logger.info("restored checkpoint step %d from %s", step, self.directory)
        return restored.params, restored.optimizer, dict(restored.extra or {})

    def _check_shapes(self, step: int, items: Mapping[str, dict]) -> None:
        """Raise one :class:`CheckpointError` line if an array stored in ``step`` has
        another shape than the live one at its path (read from the metadata, before any
        array: Orbax's own refusal is a page of its threads' tracebacks)."""
        where = self.directory / str(step)
        for item, live in items.items():
            try:
                stored = ocp.StandardCheckpointHandler().metadata(where / item)
            except Exception:  # unreadable metadata: the restore itself reports it
                logger.debug("no metadata for %s in %s", item, where, exc_info=True)
                continue
            stored_arrays = flatten(getattr(stored, "tree", stored))
            differ = []
            for path, leaf in flatten(live).items():
                old = getattr(stored_arrays.get(path), "shape", None)
                if old is not None and tuple(old) != np.shape(leaf):
                    differ.append((path, tuple(old), np.shape(leaf)))
            if not differ:
                continue
            path, old, new = differ[0]
            more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
            layout = ""
            if math.prod(old) == math.prod(new) and len(old) > len(new):
                layout = (
                    "; it holds multi-dimensional projection kernels, the layout strop's JAX "
                    "backend used before its kernels became flat [in, out]: resume it with the "
                    "strop version that wrote it, or start the run afresh"
                )
            raise CheckpointError(
                f"cannot restore checkpoint {where}: {item} {path} is stored as {old}, "
                f"this model's is {new}{more}{layout}"
            )

    def stored_params(self, step: int) -> list[str]:
        """Dotted paths of the parameter arrays stored in checkpoint ``step``."""
        self._require(step)
        metadata = self._manager.item_metadata(step).params
        return sorted(flatten(metadata.tree))

    def close(self) -> None:
        """Wait for pending work and release the manager's resources."""
        self._manager.close()
