"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP): same rules as JAX.

A checkpoint holds what a resumed run cannot rebuild from its config: the *trainable*
parameters (with LoRA only the adapters; ``get_state_dict(ignore_frozen_params=True)``),
the optimizer state, JSON ``extra`` from the loop (step, data position, ...) and the run
identity. Each rank writes its own shards; nothing is gathered.

Layout, one directory per step (as the JAX backend's Orbax layout)::

    <dir>/<step>/state/       DCP files (.metadata + per-rank shards)
    <dir>/<step>/extra.json
    <dir>/<step>/identity.json
    <dir>/<step>/checksums.json   size and sha256 of each file above

A step is written under ``<dir>/.tmp-<step>`` and renamed into place by rank 0 once
every rank's shards and the JSON files are on disk (and their checksums written), so a
run killed mid-save never leaves a step that looks complete; leftovers are removed when
a run opens the directory. A restore verifies the checksums before DCP reads a tensor.
Only the last ``keep`` steps are kept.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pathlib
import pickle
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from strop.backends.torch.fsdp import Placement, barrier, write_once
from strop.backends.torch.lora import hf_module_path
from strop.backends.torch.quantized import parameters_only_state_dict
from strop.errors import CheckpointError, NonFiniteStateError
from strop.io.checkpoint_dir import (
    StepCheckpoints,
    remove_unfinished_saves,
    save_failed,
    short_reason,
)
from strop.io.checksums import write_checksums
from strop.io.run_identity import check_same_run

logger = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Frozen (base) weights are not in a checkpoint, so loading cannot be strict about them;
# the trainable keys are still enforced: DCP refuses a checkpoint that lacks one.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


# DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and its default
# planner reads non-tensor entries (optimizer hyper-parameters) with
# ``torch.load(weights_only=False)``: a crafted checkpoint directory could run code on
# resume. strop reads both restricted: the metadata may only name DCP's metadata classes,
# ``torch.Size``, dtypes, layouts and paths; other entries go through ``weights_only=True``
# (tensor shards already do, in DCP itself).
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, refused")


class _SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = pathlib.Path(self.path) / (
            ".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata"
        )
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if type(metadata).__name__ != "Metadata":
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not Metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


@contextlib.contextmanager
def _dcp_quietly() -> Iterator[None]:
    """DCP warns when it runs without a process group; in a single process that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _one_line(err: BaseException) -> str:
    text = short_reason(str(err))
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _describe_failure(err: BaseException) -> str:
    """``err`` on one short line; DCP's CheckpointException as its ranks' own errors (its
    ``str`` is a multi-line traceback per rank), the first two ranks' named."""
    if isinstance(err, CheckpointException):
        failures = sorted(err.failures.items())
        named = "; ".join(
            f"rank {rank}: {_one_line(failure[0] if isinstance(failure, tuple) else failure)}"
            for rank, failure in failures[:2]
        )
        return named + (f" (and {len(failures) - 2} more ranks)" if len(failures) > 2 else "")
    return _one_line(err)


def _nonfinite_names(state: Mapping[str, Any], placement: Placement) -> list[str]:
    """Dotted names of the floating-point tensors in ``state`` holding a NaN or an Inf
    (each rank checks its shards; the verdict is agreed over all ranks)."""
    names = []
    for name, value in _tensors(state):
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            names.append(name)
    if placement.distributed:
        flag = torch.tensor([float(bool(names))], device=placement.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not names:
            names = ["state held by another rank"]
    return names


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from _tensors(value, f"{prefix}.{index}")


def _trainable_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trainable parameters' and the optimizer's state dicts, as DCP stores them (a
    QLoRA int8 base's row scales left out: :func:`parameters_only_state_dict`)."""
    with parameters_only_state_dict(model):
        return get_state_dict(model, optimizer, options=_OPTIONS)


def _write_json(path: Path, value: Any) -> None:
    with path.open("w") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


class TrainCheckpoints(StepCheckpoints):
    """The checkpoints of one run, in ``directory`` (e.g. ``<run_dir>/checkpoints``).

    Args:
      directory: created if missing; one sub-directory per saved step.
      identity: what this run is (see :func:`strop.io.run_identity.run_identity`);
        stored with every step and compared on restore.
      placement: this process's rank and mesh (rank 0 manages the directory).
      keep: how many of the most recent checkpoints to keep.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        identity: Mapping[str, Any],
        placement: Placement,
        keep: int = 3,
    ):
        super().__init__(directory, identity, keep, backend="torch", write_once=write_once)
        self.placement = placement
        if placement.is_main:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise CheckpointError(
                    f"cannot use checkpoint directory {self.directory}: {err}; choose a "
                    "writable run directory"
                ) from None
            remove_unfinished_saves(self.directory, "torch")  # a save killed half-way
        barrier(placement)

    def all_steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(
            int(entry.name)
            for entry in self.directory.iterdir()
            if entry.name.isdigit() and (entry / "identity.json").is_file()
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Write checkpoint ``step`` (collective) and return once it is complete on disk.

        On failure raises :class:`CheckpointError`; earlier checkpoints are untouched and
        nothing half-written becomes visible.
        """
        extra = self._new_step(step, extra)
        staging = self.directory / f"{_TMP_PREFIX}{step}"
        final = self.directory / str(step)
        model_state, optim_state = _trainable_state(model, optimizer)
        poisoned = _nonfinite_names({"model": model_state, "optim": optim_state}, self.placement)
        if poisoned:
            raise NonFiniteStateError(step, poisoned, self.latest_step(), str(self.directory))
        try:
            if self.placement.is_main:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            barrier(self.placement)
            with _dcp_quietly():
                dcp.save(
                    {"model": model_state, "optim": optim_state},
                    checkpoint_id=staging / "state",
                    no_dist=not self.placement.distributed,
                )
            barrier(self.placement)
            if self.placement.is_main:
                _write_json(staging / "extra.json", extra)
                _write_json(staging / "identity.json", self.identity)
                write_checksums(staging)
                os.replace(staging, final)
                self._prune()
        except (Exception, CheckpointException) as err:  # I/O failures: assorted types
            if self.placement.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            reason = _describe_failure(err)
            raise save_failed(step, self.directory, reason, self.latest_step()) from err
        barrier(self.placement)
        logger.info("saved checkpoint step %d to %s", step, self.directory)

    def _prune(self) -> None:
        for old in self.all_steps()[: -self.keep]:
            shutil.rmtree(self.directory / str(old), ignore_errors=True)

    def check_identity(self, step: int) -> None:
        """Raise :class:`CheckpointError` if checkpoint ``step`` belongs to another run."""
        self._require(step)
        path = self.directory / str(step)
        try:
            stored = json.loads((path / "identity.json").read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"cannot read {path / 'identity.json'}: {err}") from None
        check_same_run(path, stored, self.identity)

    def restore(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Load checkpoint ``step`` into the live ``model`` and ``optimizer``; return ``extra``.

        Each rank reads only its own shards. The identity is checked before any tensor
        is read.
        """
        self._verify(step)
        self.check_identity(step)
        path = self.directory / str(step)
        model_state, optim_state = _trainable_state(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        try:
            _SafeReader(path / "state").read_metadata()  # refuse a bad one before DCP logs it
            with _dcp_quietly():
                dcp.load(
                    state,
                    storage_reader=_SafeReader(path / "state"),
                    planner=_SafeLoadPlanner(),
                    no_dist=not self.placement.distributed,
                )
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=_LOAD_OPTIONS,
            )
            extra = json.loads((path / "extra.json").read_text())
        # structure/shape mismatch or unreadable files; DCP's CheckpointException is a
        # BaseException, so it is named here.
        except (Exception, CheckpointException) as err:
            raise CheckpointError(
                f"cannot restore checkpoint {path}: {_describe_failure(err)}"
            ) from err
        logger.info("restored checkpoint step %d from %s", step, self.directory)
        return extra

    def stored_params(self, step: int) -> list[str]:
        """HF-style names of the parameters stored in checkpoint ``step``."""
        self._require(step)
        try:
            metadata = _SafeReader(self.directory / str(step) / "state").read_metadata()
        except (OSError, pickle.UnpicklingError) as err:
            raise CheckpointError(f"cannot read checkpoint step {step}: {err}") from None
        return sorted(
            hf_module_path(key.removeprefix("model."))
            for key in metadata.state_dict_metadata
            if key.startswith("model.")
        )
