"""Move weights between a Hugging Face checkpoint directory and the NNX model.

Loading builds the model abstractly (``nnx.eval_shape``: shapes only, no memory), then
reads one tensor at a time on the host and places it straight onto its sharding on the
mesh with ``jax.make_array_from_callback``, so each device only ever receives its own
shard. Saving gathers one weight at a time and writes a directory ``transformers`` loads.
Routed experts' kernels are stacked ``[experts, ...]`` in the model and stored one tensor
per expert in the checkpoint (``mlp.experts.E.gate_proj.weight``), as Qwen3-MoE's are.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from rich.progress import track

from strop.backends.jax.layers import Dense, Embedding, RMSNorm
from strop.backends.jax.model import CausalLM
from strop.backends.jax.moe import Experts
from strop.backends.jax.sharding import is_main_process, logical_to_sharding, to_host, write_once
from strop.io.hf import SafetensorsReader, check_tensors, open_checkpoint, write_checkpoint_once


@dataclass(frozen=True)
class WeightBinding:
    """One model weight and its HF counterpart: the tensor's name, its shape, layout
    conversions both ways, and the ``blocks`` its dims are sharded in (see
    ``sharding.logical_to_partition_spec``). A weight ``stacked`` on a leading axis (the
    routed experts' kernels) has one tensor per slice: ``hf_names`` in slice order, each of
    ``hf_shape``, converted one by one."""

    hf_names: tuple[str, ...]
    variable: nnx.Variable
    hf_shape: tuple[int, ...]
    to_model: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    blocks: tuple[int, ...] | None = None
    stacked: bool = False

    @property
    def tensors(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors this weight is made of: name -> shape."""
        return dict.fromkeys(self.hf_names, self.hf_shape)

    def read(self, reader: SafetensorsReader) -> np.ndarray:
        """The weight's value in the model's layout, from the checkpoint's tensors."""
        values = [self.to_model(reader.get(name)) for name in self.hf_names]
        return np.stack(values) if self.stacked else values[0]

    def hf_tensors(self, value: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        """The model's ``value`` as (HF tensor name, array) pairs, slice by slice."""
        slices = value if self.stacked else (value,)
        for name, part in zip(self.hf_names, slices, strict=True):
            yield name, self.to_hf(part)

    def sharding(self, mesh: Mesh) -> NamedSharding:
        """Where this weight lives on ``mesh``, from its logical axes."""
        axes = self.variable.get_metadata()["out_sharding"]
        return logical_to_sharding(axes, self.variable.get_value().shape, mesh, self.blocks)


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T


def weight_bindings(model: CausalLM) -> list[WeightBinding]:
    """Every weight of ``model`` paired with its HF tensor name(s) and layout conversions.

    HF ``nn.Linear.weight`` is ``[out, in]`` and a :class:`Dense` kernel ``[in, out]``: the
    conversion is a transpose, and so it is for each expert's slice of a stacked
    :class:`~strop.backends.jax.moe.Experts` kernel; biases and the rest are taken as they are.
    """
    bindings = []
    for path, module in nnx.iter_modules(model):
        prefix = ".".join(str(p) for p in path)
        if isinstance(module, Dense):
            n_in, n_out = math.prod(module.in_shape), math.prod(module.out_shape)
            blocks = module.kernel_blocks()
            bindings.append(
                WeightBinding(
                    (f"{prefix}.weight",), module.kernel, (n_out, n_in), _transpose, _transpose,
                    blocks,
                )
            )  # fmt: skip
            if module.bias is not None:
                bindings.append(
                    WeightBinding(
                        (f"{prefix}.bias",), module.bias, (n_out,), _identity, _identity,
                        blocks[1:],
                    )
                )  # fmt: skip
        elif isinstance(module, Embedding | RMSNorm):
            variable = module.embedding if isinstance(module, Embedding) else module.weight
            bindings.append(
                WeightBinding(
                    (f"{prefix}.weight",), variable, tuple(variable.shape), _identity, _identity
                )
            )
        elif isinstance(module, Experts):
            bindings.extend(_expert_bindings(prefix, module))
    return bindings


def _expert_bindings(prefix: str, experts: Experts) -> Iterator[WeightBinding]:
    """A stacked kernel per projection, each bound to its experts' HF tensors
    (``{prefix}.{e}.{name}.weight``, ``[out, in]``: the transpose of slice ``e``)."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        variable = getattr(experts, name)
        count, n_in, n_out = variable.shape
        names = tuple(f"{prefix}.{e}.{name}.weight" for e in range(count))
        yield WeightBinding(names, variable, (n_out, n_in), _transpose, _transpose, stacked=True)


def expected_tensors(bindings: list[WeightBinding]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the ``bindings`` read, by name: its shape."""
    return {name: shape for binding in bindings for name, shape in binding.tensors.items()}


def load_hf_model(
    path: str | os.PathLike, mesh: Mesh, *, dtype: str = "float32", param_dtype: str = "float32"
) -> CausalLM:
    """Load a HF checkpoint directory into a :class:`CausalLM` sharded over ``mesh``."""
    spec, reader = open_checkpoint(path)
    model = nnx.eval_shape(
        lambda: CausalLM(spec, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )
    bindings = weight_bindings(model)
    # Names and shapes from the headers, before a single weight is read or placed.
    check_tensors(reader, expected_tensors(bindings), tied=spec.tie_word_embeddings)
    place_weights(bindings, reader, mesh, "loading weights")
    return model


def place_weights(
    bindings: list[WeightBinding], reader: SafetensorsReader, mesh: Mesh, description: str
) -> None:
    """Read each binding's tensor and place it, in the model's dtype, sharded over ``mesh``
    (one tensor on the host at a time; a progress bar on a terminal)."""
    disable = not sys.stderr.isatty()
    for binding in track(bindings, description=description, transient=True, disable=disable):
        variable = binding.variable
        abstract = variable.get_value()
        host = binding.read(reader).astype(abstract.dtype)
        sharding = binding.sharding(mesh)
        variable.set_value(
            jax.make_array_from_callback(abstract.shape, sharding, lambda index, h=host: h[index])
        )


def hf_weights(model: CausalLM) -> Iterator[tuple[str, np.ndarray]]:
    """``model``'s weights as (HF tensor name, host array) pairs, one at a time (a sharded
    weight is gathered to the host as it is reached: every process iterates together)."""
    for binding in weight_bindings(model):
        yield from binding.hf_tensors(to_host(binding.variable.get_value()))


def save_hf_model(
    model: CausalLM,
    path: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 4 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a HF checkpoint directory (config.json + safetensors).

    Weights keep their parameter dtype. Every process takes part in gathering sharded
    weights; process 0 writes, and every process returns once the directory is complete.
    Tokenizer files are copied from ``source_dir``.
    """
    dtype_name = np.dtype(weight_bindings(model)[0].variable.get_value().dtype).name
    return write_checkpoint_once(
        path,
        model.spec.raw,
        hf_weights(model),
        is_main=is_main_process(),
        write_once=write_once,
        dtype_name=dtype_name,
        source_dir=source_dir,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )
