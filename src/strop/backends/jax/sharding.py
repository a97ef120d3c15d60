"""The device mesh and the rules that map logical weight axes to mesh axes.

Every weight of the model carries logical axis names (``vocab``, ``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``norm``) in its ``out_sharding`` metadata. The rules
below say which mesh axis (``data``, ``fsdp``, ``tensor``) each logical axis is split over.
A dimension that a mesh axis does not divide evenly stays replicated on that axis (for
example 2 KV heads on ``tensor=4``), so any model runs on any mesh.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pydantic import ValidationError

from strop.config import MeshConfig
from strop.errors import ConfigError

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None

# Logical axis -> mesh axis (or axes). FSDP shards the model dimension; tensor parallelism
# shards heads, MLP width and vocabulary; batches split over data x fsdp.
LOGICAL_AXIS_RULES: Mapping[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
}


def device_count() -> int:
    """The devices a mesh spans: every device of every process."""
    return jax.device_count()


def shut_down() -> None:
    """Leave JAX's distributed system if this process joined one (multi-host), once its
    work has finished; a no-op in a single process."""
    jax.distributed.shutdown()


def make_mesh(
    sizes: MeshConfig | Mapping[str, int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``Mesh`` with axes ``(data, fsdp, tensor)`` over ``devices`` (default: all).

    ``sizes`` is a :class:`MeshConfig` or a mapping such as ``{"fsdp": 4, "tensor": 2}``;
    ``-1`` means "all remaining devices" and missing axes take the config defaults
    (``fsdp=-1``, others 1).
    """
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
) -> PartitionSpec:
    """The ``PartitionSpec`` for an array of ``shape`` whose dims have ``logical_axes``.

    A mesh axis is used at most once per array, and only on a dimension it divides.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not fit shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for name, dim in zip(logical_axes, shape, strict=True):
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
                logger.debug("dim %s (%s) not divisible by mesh axis %s", dim, name, axis)
                continue
            chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def logical_to_sharding(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh
) -> NamedSharding:
    """``NamedSharding`` on ``mesh`` for an array with the given logical axes and shape."""
    return NamedSharding(mesh, logical_to_partition_spec(logical_axes, shape, mesh))


def batch_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """Sharding for a ``[B, ...]`` batch array: B over ``data`` x ``fsdp`` where it divides."""
    return logical_to_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh)
