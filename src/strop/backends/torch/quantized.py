"""QLoRA on torch: the frozen base loaded quantized by bitsandbytes (``lora.base_quantization``).

transformers' ``BitsAndBytesConfig`` is the front door: ``from_pretrained`` replaces
every ``nn.Linear`` but the LM head by ``bnb.nn.Linear4bit`` (``nf4``, computing in
``model.dtype``) or ``bnb.nn.Linear8bitLt`` (``int8``, LLM.int8 with int8 weights) and
quantizes each weight as it loads: the base is never held in full precision. PEFT then
wraps those layers with its bitsandbytes LoRA layers, whose adapters are float32 as over
any base. PEFT's ``prepare_model_for_kbit_training`` is not called: it freezes the base
(PEFT does), upcasts the non-quantized weights (embeddings, norms, LM head) to float32
(strop keeps them at ``model.param_dtype`` and computes under autocast,
:meth:`~strop.backends.torch.model.LoadedModel.autocast`) and sets up gradient
checkpointing, which strop does not use.

What runs where (bitsandbytes 0.50): both kinds on CUDA and on CPU (4-bit through a
slower fallback without the optional ``kernels`` package); one process only (FSDP2 does
not shard bitsandbytes' packed weights here): :func:`strop.quantization.refuse_unsupported`
says so in one line. :func:`dense_weight` is the way back to a full-precision tensor (exports,
merged-weight sync), one layer at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
import transformers

# What ``Linear8bitLt._save_to_state_dict`` adds to a state dict beside its parameters.
_INT8_EXTRA_STATE = ("SCB", "weight_format")


class _FirstCastWarningOnly(logging.Filter):
    """Lets bitsandbytes' "MatMul8bitLt: inputs will be cast ... to float16" through once per
    process: it logs it at every int8 matmul on CUDA, the same words each time (a PPO run
    of two iterations printed 4,844 of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("MatMul8bitLt: inputs will be cast"):
            return True
        first, self.seen = not self.seen, True
        return first


_CAST_WARNING_ONCE = _FirstCastWarningOnly()


def bnb_config(kind: str, compute_dtype: torch.dtype) -> transformers.BitsAndBytesConfig:
    """transformers' quantization config for ``kind`` (nf4: 4-bit NormalFloat, computing
    in ``compute_dtype``; int8: LLM.int8 with int8 weights)."""
    if kind == "nf4":
        return transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype
        )
    if kind == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"unknown base quantization {kind!r}")


def load_quantized(
    path: str | os.PathLike,
    kind: str,
    *,
    device: torch.device,
    stored_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The checkpoint at ``path`` with its linear layers quantized as ``kind`` on
    ``device`` (the other weights stored in ``stored_dtype``), every weight frozen."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=bnb_config(kind, compute_dtype),
        dtype=stored_dtype,
        device_map={"": device},
        trust_remote_code=trust_remote_code,
    )
    model.requires_grad_(False)
    cast_logger = logging.getLogger("bitsandbytes.autograd._functions")
    if _CAST_WARNING_ONCE not in cast_logger.filters:
        cast_logger.addFilter(_CAST_WARNING_ONCE)
    for layer in quantized_layers(model).values():
        # bitsandbytes 0.50 repacks a 4-bit weight in place for its AVX512-BF16 CPU kernel
        # at the first forward without gradients (a rollout, a reference pass); every
        # later forward then takes that kernel, whose in-place bias add fails under
        # autograd. The base keeps its one layout (and its bits) for every forward.
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False
    return model


@contextlib.contextmanager
def parameters_only_state_dict(model: torch.nn.Module) -> Iterator[None]:
    """While open, ``model.state_dict()`` leaves out what bitsandbytes' int8 layers add
    besides their parameters: the weight's row scales (``SCB``) and ``weight_format``.

    torch's distributed-checkpoint API resolves every state-dict key to a module attribute,
    and these two are none (``'Linear8bitLt' object has no attribute 'SCB'``, at every
    save of a QLoRA int8 run). A checkpoint holds no frozen base weight anyway: the base
    is quantized again from ``model.path`` when the run resumes.
    """
    handles = [
        module.register_state_dict_post_hook(_drop_int8_extra_state)
        for module in model.modules()
        if type(module).__name__ == "Linear8bitLt"  # no bitsandbytes import without QLoRA
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _drop_int8_extra_state(
    module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict
) -> None:
    for name in _INT8_EXTRA_STATE:
        state_dict.pop(prefix + name, None)


def is_quantized(param: torch.Tensor) -> bool:
    """A bitsandbytes weight (``Params4bit`` packed 4-bit, or ``Int8Params``)."""
    return type(param).__name__ in ("Params4bit", "Int8Params")


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """bitsandbytes' linear layers in ``model`` by module name (not PEFT's wrappers)."""
    import bitsandbytes as bnb

    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return {name: module for name, module in model.named_modules() if type(module) in kinds}


def scales(layer: torch.nn.Module) -> torch.Tensor:
    """The scales of a quantized layer's weight: nf4's absmax per block, int8's per row
    (``Linear8bitLt`` moves them from the weight to its ``state`` at its first forward)."""
    weight = layer.weight
    if type(weight).__name__ == "Params4bit":
        return weight.quant_state.absmax
    return weight.SCB if getattr(weight, "SCB", None) is not None else layer.state.SCB


def dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight of a bitsandbytes linear ``layer`` dequantized: a new float32
    ``[out, in]`` tensor, for this one layer."""
    import bitsandbytes.functional as F

    weight = layer.weight
    if type(weight).__name__ == "Params4bit":
        return F.dequantize_4bit(weight.data, weight.quant_state).float()
    return F.int8_vectorwise_dequant(weight.data, scales(layer)).float()
