"""Processes, the device mesh and FSDP2 sharding for the torch backend.

Launched under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) strop joins the
process group (NCCL on CUDA, gloo on CPU) and shards the model with FSDP2
(``fully_shard`` on every decoder layer, then the root), so every parameter is a
``DTensor``. Launched as a plain process it runs unsharded on one device.

Gradient reduction: strop's losses are *sums* over a rank's tokens divided by the
*global* token count (see ``train.py``), so the correct data-parallel gradient is the
plain **sum** of the ranks' gradients. FSDP2 is told exactly that (divide factor 1, sum
reductions only) instead of relying on its default average: over gloo, FSDP2's
``ReduceOp.AVG`` has been reported to silently sum (pytorch issue 162338), and an
average would be wrong for token-normalised losses anyway. The two-process test holds
the sharded gradients to a single-process run either way.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from strop.config import MeshConfig
from strop.cpu_threads import busy_cores_warning, torch_threads, usable_cores
from strop.errors import ConfigError
from strop.io.atomic import write_on_one_process

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Placement:
    """Where this process runs: its device, rank, world size and (if sharded) mesh."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files, logs and progress bars."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None


def launched_distributed() -> bool:
    """True under ``torchrun`` (or any launcher that sets ``WORLD_SIZE`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized()


def device_count() -> int:
    """The devices a mesh spans: one per process (``WORLD_SIZE`` under ``torchrun``)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def shut_down() -> bool:
    """Leave the process group, once a process's work has finished on every rank; return
    whether there was one.

    Only for a successful exit: on an error the other ranks may sit in a collective that
    would never finish, and ``torchrun`` stops them. Even after this, gloo's threads can
    still hold tensors while the interpreter finalizes, and a rank then aborts at exit
    ("terminate called without an active exception", SIGABRT) after a run that
    succeeded; the CLI therefore ends such a process without finalizing it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    return True


def join_process_group() -> int:
    """Join the launcher's process group (NCCL on CUDA, gloo on CPU) unless joined; on
    CUDA the device is ``LOCAL_RANK``'s. Returns the local rank."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return local_rank


def is_main_process() -> bool:
    """Rank 0 (or a process launched alone) writes files, logs and progress bars."""
    return not dist.is_initialized() or dist.get_rank() == 0


def write_once(write: Callable[[], object], what: str) -> None:
    """Run ``write`` (``what`` it does: "writing X") on rank 0 only; every rank returns once it has
    ended, and raises if it failed (:func:`strop.io.atomic.write_on_one_process`)."""
    if launched_distributed():
        join_process_group()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        write()
        return
    write_on_one_process(write, what, is_main=is_main_process(), share=_broadcast_text)


def _broadcast_text(text: str) -> str:
    """Rank 0's ``text`` on every rank."""
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def place(mesh_config: MeshConfig) -> Placement:
    """Join the process group if launched distributed, pick the device, build the mesh,
    and set torch's CPU threads (:mod:`strop.cpu_threads`).

    The mesh's ``data`` axis replicates and its ``fsdp`` axis shards (HSDP when both are
    > 1); tensor parallelism is refused with a clear message for now.
    """
    cuda = torch.cuda.is_available()
    _set_cpu_threads()
    _refuse_tensor_parallel({"tensor": mesh_config.tensor})
    if not launched_distributed():
        sizes = mesh_config.resolve(1)
        _refuse_tensor_parallel(sizes)
        return Placement(torch.device("cuda" if cuda else "cpu"))
    local_rank = join_process_group()
    world = dist.get_world_size()
    sizes = mesh_config.resolve(world)
    _refuse_tensor_parallel(sizes)
    device_type = "cuda" if cuda else "cpu"
    if sizes["data"] > 1:
        mesh = init_device_mesh(
            device_type, (sizes["data"], sizes["fsdp"]), mesh_dim_names=("data", "fsdp")
        )
    else:
        mesh = init_device_mesh(device_type, (sizes["fsdp"],), mesh_dim_names=("fsdp",))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    logger.info("rank %d/%d on %s, mesh %s", dist.get_rank(), world, device, mesh)
    return Placement(device, dist.get_rank(), world, mesh)


def _set_cpu_threads() -> None:
    """This process's share of the usable cores (:mod:`strop.cpu_threads`), and a warning
    when the machine's load says they are busy; ``OMP_NUM_THREADS`` wins."""
    threads = torch_threads()
    if threads is None:
        return
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    warning = busy_cores_warning(threads, usable_cores(), os.getloadavg()[0])
    if warning and warning not in _WARNED:
        _WARNED.add(warning)  # once per process
        logger.warning(warning)


_WARNED: set[str] = set()


def _refuse_tensor_parallel(sizes: dict[str, int]) -> None:
    if sizes["tensor"] > 1:
        raise ConfigError(
            f"mesh.tensor={sizes['tensor']}: tensor parallelism is not supported by the torch "
            "backend yet; use mesh.fsdp (and mesh.data) for data parallelism"
        )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (classes the model lists in ``_no_split_modules``)."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return layers


def shard_model(model: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root; gradients reduce by plain sum."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return shard_module(model, mesh, compute_dtype)


def shard_module(module: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype) -> nn.Module:
    """``fully_shard`` ``module`` as one unit (e.g. PPO's value head); every FSDP module
    inside it reduces gradients by plain sum (see the module docstring)."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    for inner in module.modules():
        if isinstance(inner, FSDPModule):
            inner.set_gradient_divide_factor(1.0)
            inner.set_force_sum_reduction_for_comms(True)
    return module


def all_gather_rows(tensor: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Concatenate every rank's ``[rows, ...]`` tensor in rank order (equal shapes)."""
    if not placement.distributed:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(placement.world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def all_reduce_sum(value: float, placement: Placement) -> float:
    """Sum a host float over all ranks (identity when not distributed)."""
    return _all_reduce(value, placement, dist.ReduceOp.SUM)


def all_reduce_max(value: float, placement: Placement) -> float:
    """The largest of a host float over all ranks (identity when not distributed)."""
    return _all_reduce(value, placement, dist.ReduceOp.MAX)


def _all_reduce(value: float, placement: Placement, op: dist.ReduceOp) -> float:
    if not placement.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=placement.device)
    dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def barrier(placement: Placement) -> None:
    if placement.distributed:
        dist.barrier()


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a whole (unsharded, host) tensor into ``param``, sharded or not.

    For a DTensor each rank keeps only its own shard of ``full`` (``src_data_rank=None``:
    every rank already holds the whole tensor, so nothing is communicated).
    """
    if isinstance(param, DTensor):
        local = distribute_tensor(
            full.to(param.to_local().device, param.dtype),
            param.device_mesh,
            param.placements,
            src_data_rank=None,
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(dtype=param.dtype, device=param.device))


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether some parameter of ``model`` is a ``DTensor`` (FSDP2 sharded it)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


@contextlib.contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every FSDP2 module of ``model`` holds its full weights: gathered
    once on entry (one all-gather per module), kept through every forward, freed on exit.

    Training keeps weights sharded and gathers each layer's for its forward; a decode loop
    would then gather every weight at every token. This costs one full copy of the weights
    per rank for the length of the block. Every rank must enter it together (the gathers
    are collectives); inside, forwards run no collective, so ranks may stop decoding
    after different numbers of steps. A model without FSDP2 modules is left alone.
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        yield
        return
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    for handle in [module.unshard(async_op=True) for module in modules]:
        handle.wait()
    try:
        yield
    finally:
        root = modules[0]  # the outermost: FSDP2 never reshards the root after forward
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(module is not root, recurse=False)
