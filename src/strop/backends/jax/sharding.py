"""The device mesh and the rules that map logical weight axes to mesh axes.

Every weight of the model carries logical axis names (``vocab``, ``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``expert``, ``norm``) in its ``out_sharding``
metadata. The rules below say which mesh axis (``data``, ``fsdp``, ``tensor``) each
logical axis is split over.
A dimension that a mesh axis does not divide evenly stays replicated on that axis (for
example 2 KV heads on ``tensor=4``), so any model runs on any mesh. A flattened dimension
(a projection kernel's ``heads x head_dim``) carries its leading name and is split only
into whole units of it (``blocks``: whole heads, never part of one).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pydantic import ValidationError

from strop.config import MeshConfig
from strop.errors import ConfigError
from strop.io.atomic import write_on_one_process

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None

# Logical axis -> mesh axis (or axes). FSDP shards the model dimension; tensor parallelism
# shards heads, MLP width and vocabulary; batches split over data x fsdp. Routed experts'
# stacked kernels ([expert, embed, mlp]) put whole experts on each fsdp shard (the expert
# dim comes first, so it takes fsdp and embed stays whole; gathered on use like any FSDP
# weight); where fsdp does not divide the experts, the embed dim takes it instead.
LOGICAL_AXIS_RULES: Mapping[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "expert": "fsdp",
    "norm": None,
}


def join_processes() -> None:
    """Join JAX's distributed system when launched as one of several processes.

    A multi-process launch sets ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0)
    and, unless a cluster manager JAX detects (Slurm, Open MPI, TPU pods, ...) says so,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. Called before the first device query;
    once joined, ``jax.devices()`` lists every process's devices and a mesh spans them.
    Without ``JAX_COORDINATOR_ADDRESS`` this is a single process and nothing happens.
    """
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if jax.distributed.is_initialized() or not address:
        return
    count, index = _env_int("JAX_NUM_PROCESSES", 1), _env_int("JAX_PROCESS_ID", 0)
    if count is not None and index is not None and index >= count:
        raise ConfigError(f"JAX_PROCESS_ID={index} is not below JAX_NUM_PROCESSES={count}")
    # CPU processes exchange collectives over gloo (accelerators use their own links).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(num_processes=count, process_id=index)
    except (RuntimeError, ValueError) as err:  # a coordinator that never answers, ...
        text = " ".join(str(err).split())[:300]
        raise ConfigError(
            f"cannot join the JAX processes at JAX_COORDINATOR_ADDRESS={address} "
            f"(process {index} of {count}): {text}"
        ) from None
    logger.info(
        "process %d of %d, %d of %d devices here",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
    )  # fmt: skip


def to_host(array: jax.Array) -> np.ndarray:
    """The full value of ``array`` on this host, also when it is sharded over devices of
    other processes (multi-process: every process must call this, in the same order)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def host_floats(stats: dict[str, jax.Array]) -> dict[str, float]:
    """A step's scalar statistics as Python floats."""
    return {name: float(value) for name, value in jax.device_get(stats).items()}


def is_main_process() -> bool:
    """Process 0 writes files, logs and progress bars."""
    return jax.process_index() == 0


def write_once(write: Callable[[], object], what: str) -> None:
    """Run ``write`` (``what`` it does: "writing X") in process 0 only; every process returns once
    it has ended, and raises if it failed (:func:`strop.io.atomic.write_on_one_process`)."""
    join_processes()
    if jax.process_count() == 1:
        write()
        return
    write_on_one_process(write, what, is_main=is_main_process(), share=_broadcast_text)


_TEXT_BYTES = 1024


def _broadcast_text(text: str) -> str:
    """Process 0's ``text`` (at most 1 KiB of UTF-8 of it) in every process."""
    data = text.encode()[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0")
    shared = multihost_utils.broadcast_one_to_all(np.frombuffer(data, dtype=np.uint8))
    return bytes(np.asarray(shared, dtype=np.uint8)).rstrip(b"\0").decode(errors="replace")


def _env_int(name: str, minimum: int) -> int | None:
    """The integer environment variable ``name`` (``None`` if unset: JAX detects it)."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"{name}={text!r} must be an integer of at least {minimum}")
    return value


def device_count() -> int:
    """The devices a mesh spans: every device of every process."""
    join_processes()
    return jax.device_count()


def shut_down() -> bool:
    """Leave JAX's distributed system if this process joined one (multi-host), once its
    work has finished; a no-op in a single process. Returns ``False``: the process may
    then end normally."""
    jax.distributed.shutdown()
    return False


def make_mesh(
    sizes: MeshConfig | Mapping[str, int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``Mesh`` with axes ``(data, fsdp, tensor)`` over ``devices`` (default: all).

    ``sizes`` is a :class:`MeshConfig` or a mapping such as ``{"fsdp": 4, "tensor": 2}``;
    ``-1`` means "all remaining devices" and missing axes take the config defaults
    (``fsdp=-1``, others 1).
    """
    if devices is None:
        join_processes()
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(sizes, MeshConfig):
        try:
            sizes = MeshConfig.model_validate(dict(sizes or {}))
        except ValidationError as err:
            raise ConfigError(f"mesh {dict(sizes or {})}: {err.errors()[0]['msg']}") from None
    shape = sizes.resolve(len(devices))
    return Mesh(np.asarray(devices).reshape([shape[axis] for axis in MESH_AXES]), MESH_AXES)


def logical_to_partition_spec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES,
    blocks: Sequence[int] | None = None,
) -> PartitionSpec:
    """The ``PartitionSpec`` for an array of ``shape`` whose dims have ``logical_axes``.

    A mesh axis is used at most once per array, and only on a dimension it divides into
    whole ``blocks`` (elements per unit of the dim's logical axis, default 1: a flat
    ``[embed, heads * head_dim]`` kernel has blocks ``(1, head_dim)``, so its second dim
    splits only where the number of heads divides).
    """
    blocks = tuple(blocks) if blocks is not None else (1,) * len(shape)
    if len(logical_axes) != len(shape) or len(blocks) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not fit shape {tuple(shape)}")
    if any(block < 1 or dim % block for dim, block in zip(shape, blocks, strict=True)):
        raise ValueError(f"blocks {blocks} do not tile shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for name, length, block in zip(logical_axes, shape, blocks, strict=True):
        dim = length // block  # units of the logical axis (heads, not heads x head_dim)
        if name is not None and name not in rules:
            raise ValueError(f"no sharding rule for logical axis {name!r}")
        mapped = rules.get(name) if name is not None else None
        candidates = (mapped,) if isinstance(mapped, str) else tuple(mapped or ())
        chosen: list[str] = []
        for axis in candidates:
            size = mesh.shape[axis]
            if axis in used or size == 1:
                continue
            if dim % (math.prod(mesh.shape[a] for a in chosen) * size):
                logger.debug("%s %s not divisible by mesh axis %s", dim, name, axis)
                continue
            chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def logical_to_sharding(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    blocks: Sequence[int] | None = None,
) -> NamedSharding:
    """``NamedSharding`` on ``mesh`` for an array with the given logical axes and shape
    (``blocks``: see :func:`logical_to_partition_spec`)."""
    spec = logical_to_partition_spec(logical_axes, shape, mesh, blocks=blocks)
    return NamedSharding(mesh, spec)


def batch_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """Sharding for a ``[B, ...]`` batch array: B over ``data`` x ``fsdp`` where it divides."""
    return logical_to_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh)


def put_rows(array: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host ``[B, ...]`` array on ``mesh``, its rows split as :func:`batch_sharding` says."""
    return jax.device_put(np.asarray(array), batch_sharding(np.shape(array), mesh))


BATCH_AXES = ("data", "fsdp")
"""Mesh axes the rows of a batch are split over; weights sharded over them are gathered."""


def inference_layout(model: nnx.Module) -> nnx.Module:
    """``model`` over a copy of its weights that is replicated over the batch axes
    (``data``, ``fsdp``) and still sharded over ``tensor``; ``model`` itself if no weight
    is sharded over a batch axis (nothing is copied).

    Training shards weights over ``fsdp`` and gathers each one when a step uses it: once per
    step is cheap for a training step, but a decode loop would gather every weight at every
    token (and XLA does not hoist the gathers out of the loop: it gathers activations and
    reduces partial sums in every step instead). With the weights laid out once per call,
    each device decodes its own rows with no collective but the loop's "all rows done?"
    reduction. Costs one full copy of the weights per device (per ``tensor`` shard) for the
    length of the call.
    """
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    moved = {i: _inference_sharding(x) for i, x in enumerate(leaves)}
    moved = {i: t for i, t in moved.items() if t != getattr(leaves[i], "sharding", None)}
    if not moved:
        return model
    copies = _resharder(tuple(moved.values()))(*(leaves[i] for i in moved))
    leaves = list(leaves)
    for i, copy in zip(moved, copies, strict=True):
        leaves[i] = copy
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _inference_sharding(x):
    """``x``'s sharding without the batch axes (``x``'s own if it is not a sharded array)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or not isinstance(sharding, NamedSharding):
        return sharding
    spec = PartitionSpec(*(_without_batch_axes(axes) for axes in sharding.spec))
    return NamedSharding(sharding.mesh, spec)


@functools.lru_cache(maxsize=8)
def _resharder(targets: tuple[NamedSharding, ...]):
    """One jitted copy per layout (cached: a rollout phase does not retrace it)."""
    return jax.jit(lambda *leaves: leaves, out_shardings=targets)


def _without_batch_axes(axes):
    if axes is None or isinstance(axes, str):
        return None if axes in BATCH_AXES else axes
    kept = tuple(axis for axis in axes if axis not in BATCH_AXES)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
