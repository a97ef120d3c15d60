"""``lora.base_quantization`` (QLoRA): which backend, install and launch can run it.

Backend-neutral (imports no framework): :func:`refuse_unsupported` is what preflight
checks before anything loads, and what the torch backend checks again when it builds a
model (JAX runs both kinds wherever it runs). The torch backend quantizes through bitsandbytes
(:mod:`strop.backends.torch.quantized`), the JAX backend through Qwix
(:func:`strop.backends.jax.lora.apply_lora`).
"""

from __future__ import annotations

import importlib.util
import logging

from strop.config import Config
from strop.errors import ConfigError

logger = logging.getLogger(__name__)


def say_merged_export_dequantizes(config: Config) -> None:
    """Log, once per merged export of a QLoRA run, that the base was dequantized."""
    if config.lora.enabled and config.lora.base_quantization != "none":
        logger.info(
            "export: the %s base dequantized to %s, the adapter merged into it",
            config.lora.base_quantization, config.model.param_dtype,
        )  # fmt: skip


def refuse_unsupported(kind: str, *, backend: str, distributed: bool) -> None:
    """One line for a ``lora.base_quantization`` this backend, install or launch cannot
    run (``kind`` none passes)."""
    if kind == "none":
        return
    if backend == "jax":
        return  # Qwix, which the jax extra brings
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
