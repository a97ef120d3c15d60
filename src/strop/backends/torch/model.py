"""Build a ``transformers`` causal LM from a HF checkpoint directory, shard by shard.

The model's parameters are created on the meta device (no memory), LoRA adapters are
injected, FSDP2 shards it when launched distributed, and only then is memory allocated
(:func:`allocate`) and filled one safetensors tensor at a time, each rank keeping its own
shard. A model that does not fit on one device therefore never has to. The same path
serves a single process: there ``to_empty`` allocates the whole model on its device.

Positions follow the JAX backend: they count from each row's first real token, so left
padding (prompts) and right padding (training batches) give the same logits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn

from strop.backends.torch.fsdp import TORCH_DTYPES, Placement, copy_full_into, shard_model
from strop.backends.torch.lora import (
    apply_lora,
    full_tensor,
    hf_module_path,
    initial_value,
    is_lora_param,
)
from strop.backends.torch.masks import model_attention_mask
from strop.backends.torch.quantized import dense_weight, is_quantized, load_quantized
from strop.config import Config, LoraConfig
from strop.errors import ModelError
from strop.io.experts import StackedExpertsReader, per_expert
from strop.io.hf import check_tensors, open_checkpoint
from strop.models import ModelSpec
from strop.quantization import refuse_unsupported

logger = logging.getLogger(__name__)


def check_model(spec: ModelSpec) -> None:
    """Every decoder transformers builds runs here; one that no family of strop's declares
    is said once (the jax backend refuses it, and parity with JAX is not tested for it)."""
    if not spec.registered:
        logger.warning(
            "model_type %r is not a family strop declares: the torch backend runs it as "
            "transformers' %s; the jax backend does not have it (docs/models.md)",
            spec.family, spec.architecture,
        )  # fmt: skip


@dataclass
class LoadedModel:
    """A built model and what the backend needs to run it."""

    model: nn.Module
    spec: ModelSpec
    placement: Placement
    compute_dtype: torch.dtype

    @functools.cached_property
    def stored_dtypes(self) -> frozenset[torch.dtype]:
        """The dtypes the weights are stored in: ``param_dtype``, and float32 for LoRA
        adapters (PEFT keeps them in float32 over a lower-precision base); a quantized
        base's packed integer weights (:mod:`strop.backends.torch.quantized`) aside."""
        return frozenset(p.dtype for p in self.model.parameters() if p.dtype.is_floating_point)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Compute in ``compute_dtype`` when some weight is stored in another dtype.

        FSDP2's mixed-precision policy does this for sharded models; a single process
        uses autocast instead. So float32 adapters over a bfloat16 base run their matmuls
        in bfloat16 on the activations as they are, where PEFT would otherwise copy every
        adapted layer's input to float32 (:func:`strop.backends.torch.lora.apply_lora`
        turns that copy off): on an H200 that made a LoRA step at Qwen2.5-1.5B's shapes
        slower than a full one (docs/benchmarks.md).
        """
        if self.placement.distributed or self.stored_dtypes == {self.compute_dtype}:
            yield
        else:
            with torch.autocast(self.placement.device.type, dtype=self.compute_dtype):
                yield


def build_model(
    path: str | os.PathLike,
    placement: Placement,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    lora: LoraConfig | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    extra_adapters: Sequence[str] = (),
    adapter_seeds: Mapping[str, int] | None = None,
) -> LoadedModel:
    """Load the checkpoint at ``path`` (with LoRA adapters if ``lora.enabled``: ``default``
    plus ``extra_adapters``, see :func:`apply_lora`).

    Weights are stored in ``param_dtype`` and computed in ``dtype``. LoRA adapters start
    from :mod:`strop.lora_init`'s values for ``seed`` (``adapter_seeds[name]`` for the
    adapters it lists): the JAX backend's values, on any world size.
    """
    spec, reader = open_checkpoint(path)
    try:
        hf_config = transformers.AutoConfig.from_pretrained(
            path, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise ModelError(f"{path}: transformers cannot read config.json ({err})") from None
    stored_dtype = TORCH_DTYPES[param_dtype]
    quantization = lora.base_quantization if lora is not None and lora.enabled else "none"
    refuse_unsupported(quantization, backend="torch", distributed=placement.distributed)
    try:
        model = on_meta(
            lambda: transformers.AutoModelForCausalLM.from_config(
                hf_config, dtype=stored_dtype, trust_remote_code=trust_remote_code
            )
        )
    except ValueError as err:  # transformers has no causal LM class for this config
        raise ModelError(
            f"{path}: not a causal language model transformers builds ({err})"
        ) from None
    # Names and shapes from the headers, against the meta model, before any allocation.
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    reader = StackedExpertsReader(reader, expected)
    check_tensors(reader, expected, tied=spec.tie_word_embeddings)
    if quantization != "none":
        model = load_quantized(
            path, quantization, device=placement.device, stored_dtype=stored_dtype,
            compute_dtype=TORCH_DTYPES[dtype], trust_remote_code=trust_remote_code,
        )  # fmt: skip
        model = apply_lora(model, lora, extra_adapters, on_meta=False)
        _init_adapters(model, seed, adapter_seeds)
        model.eval()
        return LoadedModel(model, spec, placement, TORCH_DTYPES[dtype])
    if lora is not None and lora.enabled:
        model = apply_lora(model, lora, extra_adapters)
    if placement.distributed:
        shard_model(model, placement.mesh, TORCH_DTYPES[dtype])
    allocate(model, placement.device)
    _load_weights(model, reader, seed, adapter_seeds)
    model.eval()
    return LoadedModel(model, spec, placement, TORCH_DTYPES[dtype])


def frozen_copy(config: Config, placement: Placement) -> LoadedModel:
    """Full fine-tuning's reference (PPO's and DPO's): ``model.path`` loaded again in the
    policy's dtypes, no adapters, no gradient (no optimizer state, not checkpointed)."""
    loaded = build_model(
        config.model_path(), placement, dtype=config.model.dtype,
        param_dtype=config.model.param_dtype, trust_remote_code=config.model.trust_remote_code,
    )  # fmt: skip
    loaded.model.requires_grad_(False)
    return loaded


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()``'s model with its parameters on the meta device (no memory) and its
    buffers computed as usual: the non-persistent ones (RoPE's frequencies per layer type,
    Gemma's embedding scale) are in no checkpoint, so they must keep their values (left
    empty, Gemma 3's gave NaN logits)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    model.tie_weights()  # init_empty_weights registers each parameter anew: tie them again
    return model


def allocate(model: nn.Module, device: torch.device) -> None:
    """Give the meta parameters of a model built by :func:`on_meta` memory on
    ``device`` (uninitialised: the checkpoint fills them), keeping tied parameters tied
    and every buffer's value."""
    tied = _shared_parameters(model)
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    _retie(tied)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) places of each parameter registered more than once (tied)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module, attr))
    return [group for group in places.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every place of a tied parameter at one tensor again (``to_empty`` unties)."""
    for (first, first_attr), *others in groups:
        for module, attr in others:
            setattr(module, attr, getattr(first, first_attr))


def _to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype.name == "bfloat16":  # ml_dtypes.bfloat16: same bits as torch.bfloat16
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def _load_weights(
    model: nn.Module,
    reader: StackedExpertsReader,
    seed: int,
    adapter_seeds: Mapping[str, int] | None = None,
) -> None:
    """Fill every parameter: base weights from the checkpoint, adapters from the seed."""
    params = dict(model.named_parameters())  # tied weights appear once
    for name, param in params.items():
        if is_lora_param(name):
            full = initial_value(name, param.shape, seed, adapter_seeds)
        else:
            tensor_name = hf_module_path(name)
            stored = reader.shape(tensor_name)
            if stored != tuple(param.shape):
                raise ModelError(
                    f"{reader.directory}: tensor {tensor_name!r} has shape {list(stored)}, "
                    f"config.json implies {list(param.shape)}"
                )
            full = _to_torch(reader.get(tensor_name))
        copy_full_into(param, full)


def _init_adapters(
    model: nn.Module, seed: int, adapter_seeds: Mapping[str, int] | None = None
) -> None:
    """Give every LoRA parameter its :mod:`strop.lora_init` value (the base is loaded)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_lora_param(name):
                copy_full_into(param, initial_value(name, param.shape, seed, adapter_seeds))


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting from each row's first real token (0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def run_model(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor | None = None,
    **outputs: Any,
) -> Any:
    """The model's forward without a cache, in its compute dtype. ``outputs``: more of the
    model's keyword arguments (``output_hidden_states=True``, ``logits_to_keep=1``).

    Without ``positions``, ``attention_mask`` is 0/1 and positions count from each row's
    first real token. With them the rows are packed (:mod:`strop.batch.packing`):
    ``attention_mask`` holds segment ids (and the shared prompt each token sees), which
    :func:`~strop.backends.torch.masks.model_attention_mask` turns into the 4-D masks
    transformers takes as they are (sliding windows built in)."""
    if positions is None:
        positions = positions_from_mask(attention_mask)
    else:
        attention_mask = model_attention_mask(
            loaded.spec, getattr(loaded.model.config, "layer_types", None), attention_mask,
            positions, loaded.compute_dtype,
        )  # fmt: skip
    with loaded.autocast():
        return loaded.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=False,
            **outputs,
        )


def final_hidden(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The final normed hidden states ``[B, L, E]`` (compute dtype): ``hidden_states[-1]``
    of the whole model's forward, so that FSDP2's and PEFT's root hooks run, with the LM
    head on the last column only (``logits_to_keep=1``)."""
    out = run_model(
        loaded, input_ids, attention_mask, positions, output_hidden_states=True,
        logits_to_keep=1,
    )  # fmt: skip
    return out.hidden_states[-1]


def forward_logits(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 logits ``[B, L, V]``."""
    return run_model(loaded, input_ids, attention_mask, positions).logits.float()


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host numpy copy; bfloat16 becomes ``ml_dtypes.bfloat16`` (same bits)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def hf_weights(
    loaded: LoadedModel, *, lora_scale: float | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """The model's weights as (HF tensor name, host array), one at a time.

    With ``lora_scale`` each adapted kernel is merged: ``W + scale * B @ A``; adapters
    are never yielded. A quantized base's weights come dequantized, at the dtype of the
    model's other weights (one layer at a time); stacked experts as the checkpoint's
    per-expert tensors (:func:`~strop.io.experts.per_expert`). Collective under FSDP
    (every rank iterates); tied weights once.
    """
    dense_dtype = next(p.dtype for p in loaded.model.parameters() if p.dtype.is_floating_point)
    modules = dict(loaded.model.named_modules())
    params = dict(loaded.model.named_parameters())
    for name, param in params.items():
        if is_lora_param(name):
            continue
        full = full_tensor(param.detach())
        if is_quantized(param):
            full = dense_weight(modules[name.removesuffix(".weight")]).to(dense_dtype)
        if lora_scale is not None and name.endswith(".base_layer.weight"):
            prefix = name.removesuffix("base_layer.weight")
            a = full_tensor(params[prefix + "lora_A.default.weight"].detach()).float()
            b = full_tensor(params[prefix + "lora_B.default.weight"].detach()).float()
            full = (full.float() + lora_scale * (b @ a)).to(full.dtype)
        yield from per_expert(hf_module_path(name), to_numpy(full))
