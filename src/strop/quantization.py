"""``lora.base_quantization`` (QLoRA): which backend, install and launch can run it.

Backend-neutral (imports no framework): :func:`refuse_unsupported` is what preflight
checks before anything loads, and what the torch backend checks again when it builds a
model. The torch backend quantizes through bitsandbytes
(:mod:`strop.backends.torch.quantized`); the JAX backend does not quantize yet.
"""

from __future__ import annotations

import importlib.util

from strop.errors import ConfigError


def refuse_unsupported(kind: str, *, backend: str, distributed: bool) -> None:
    """One line for a ``lora.base_quantization`` this backend, install or launch cannot
    run (``kind`` none passes)."""
    if kind == "none":
        return
    if backend != "torch":
        raise ConfigError(
            f"lora.base_quantization={kind}: the {backend} backend does not quantize the "
            "base yet; use backend=torch (bitsandbytes) or lora.base_quantization=none"
        )
    if distributed:
        raise ConfigError(
            f"lora.base_quantization={kind} runs on one process: FSDP2 does not shard "
            "bitsandbytes' quantized weights here (launch without torchrun, or set "
            "lora.base_quantization=none)"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"lora.base_quantization={kind} needs bitsandbytes: pip install 'strop[qlora]'"
        )
