"""LoRA on a transformers model with Hugging Face PEFT, from the same ``lora:`` config.

Targets follow :func:`strop.lora_targets.match_targets` (``re.fullmatch`` on dotted
module paths, an error when a pattern matches nothing) and are handed to PEFT as one
regex, which PEFT also matches with ``re.fullmatch``: the two backends adapt exactly the
same modules. PEFT freezes every base weight; only ``lora_A``/``lora_B`` require grad.

Adapters are injected while the model is still on the meta device (before sharding);
:func:`initial_value` then gives each its initial value from :mod:`strop.lora_init` (A
uniform in ±1/sqrt(in), PEFT's default ``kaiming_uniform(a=sqrt(5))``; B zero), a
function of (seed, module path, shape): the same on every rank, for every world size,
and the same numbers the JAX backend starts from.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import peft
import torch
from torch import nn

from strop.backends.torch.fsdp import copy_full_into
from strop.config import LoraConfig
from strop.errors import ConfigError
from strop.io.peft import AdapterWeights, check_adapter_shape, check_adapter_targets, target_regex
from strop.lora_init import lora_a, lora_b
from strop.lora_targets import match_targets

ADAPTER_NAME = "default"
_WRAPPER_PREFIX = "base_model.model."


def linear_paths(model: nn.Module) -> list[str]:
    """Dotted paths of every ``nn.Linear`` (the LoRA candidates), in model order."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def apply_lora(
    model: nn.Module, config: LoraConfig, extra_adapters: Sequence[str] = (), *, on_meta=True
) -> peft.PeftModel:
    """Wrap ``model`` (on the meta device, else ``on_meta=False``: a loaded quantized
    base) with PEFT LoRA adapters: ``default`` plus one more of the same shape per name in
    ``extra_adapters`` (PPO's critic), all over the one base. Every adapter's weights
    require grad; ``default`` is active."""
    match_targets(config.target_modules, linear_paths(model))
    peft_config = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=target_regex(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # PeftModel reads model.is_gradient_checkpointing, which transformers 5 deprecates
        # (FutureWarning on every torch run); strop never checkpoints activations.
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        wrapped = peft.get_peft_model(model, peft_config, low_cpu_mem_usage=on_meta)
    _refuse_stacked_experts(wrapped.peft_config[ADAPTER_NAME], config)
    for name in extra_adapters:
        wrapped.add_adapter(name, peft_config, low_cpu_mem_usage=on_meta)
    # PEFT freezes inactive adapters; FSDP2 fixes requires_grad when it shards, so every
    # adapter that may train must require grad from the start (see use_adapter).
    for name, param in wrapped.named_parameters():
        if is_lora_param(name):
            param.requires_grad_(True)
    # PEFT keeps adapters in float32 over a lower-precision base and copies each adapted
    # layer's input to float32 for them. strop computes under autocast instead (weights
    # cast to the compute dtype, activations as they are: LoadedModel.autocast), so the
    # copy is turned off (the attribute peft.helpers.disable_input_dtype_casting sets).
    for module in wrapped.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
    return wrapped


def _refuse_stacked_experts(applied: peft.LoraConfig, config: LoraConfig) -> None:
    """PEFT, on transformers 5, reads targets named as a MoE's expert projections were in
    transformers 4 (``gate_proj``, ``up_proj``, ``down_proj``, which a pattern like
    ``.*_proj`` matches) as the routed experts' stacked 3-D parameters too, and wraps them
    (``target_parameters``). strop adapts linear layers only (the ones
    ``ModelSpec.layer_linears`` lists, as the JAX backend does), so that is refused."""
    if getattr(applied, "target_parameters", None):
        stacked = ", ".join(sorted(applied.target_parameters))
        raise ConfigError(
            f"lora.target_modules={list(config.target_modules)}: PEFT would also adapt the "
            f"routed experts' stacked parameters ({stacked}), which strop does not; target "
            "the attention projections, e.g. ['.*self_attn\\..*_proj']"
        )


@contextlib.contextmanager
def use_adapter(model: nn.Module, adapter: str | None) -> Iterator[None]:
    """Run the enclosed forwards with only ``adapter`` active (``None``: no adapter, i.e.
    the base model), then make ``default`` active again.

    PEFT's ``set_adapter`` (also called when adapters are re-enabled) flips
    ``requires_grad`` (on for the active adapter, off for the others); every flag is put
    back as it was, so the parameters FSDP2 sharded keep
    the flags they were sharded with. An inactive adapter simply gets no gradient.
    """
    flags = [(param, param.requires_grad) for param in model.parameters()]

    def restore_flags() -> None:
        for param, flag in flags:
            param.requires_grad_(flag)

    if adapter is None:
        try:
            with model.disable_adapter():  # re-enabling also calls set_adapter
                yield
        finally:
            restore_flags()
        return
    model.base_model.set_adapter(adapter)
    restore_flags()
    try:
        yield
    finally:
        model.base_model.set_adapter(ADAPTER_NAME)
        restore_flags()


def adapter_params(model: nn.Module, adapter: str) -> list[nn.Parameter]:
    """The LoRA parameters of one named adapter."""
    return [
        param
        for name, param in model.named_parameters()
        if is_lora_param(name) and f".{adapter}." in name
    ]


def hf_module_path(name: str) -> str:
    """A PEFT-wrapped module/parameter name without the wrapper prefix and ``base_layer``."""
    name = name.removeprefix(_WRAPPER_PREFIX)
    return name.replace(".base_layer", "")


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The PEFT LoRA layers by HF module path (e.g. ``model.layers.0.self_attn.q_proj``)."""
    return {
        hf_module_path(name): module
        for name, module in model.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
    }


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def initial_value(
    name: str, shape: Sequence[int], seed: int, adapter_seeds: Mapping[str, int] | None = None
) -> torch.Tensor:
    """The initial full float32 value of LoRA parameter ``name`` (e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.critic.weight``), from
    :mod:`strop.lora_init`: A uniform ±1/sqrt(in), B zero. Adapter ``x`` is drawn from
    ``adapter_seeds[x]``, or ``seed`` when it is not listed."""
    path, kind, adapter, _ = hf_module_path(name).rsplit(".", 3)
    out_features, in_features = shape
    if kind == "lora_B":
        return torch.from_numpy(lora_b(in_features, out_features))
    adapter_seed = (adapter_seeds or {}).get(adapter, seed)
    return torch.from_numpy(lora_a(adapter_seed, path, out_features, in_features))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for DTensors)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


def adapter_weights(model: nn.Module, adapter: str = ADAPTER_NAME) -> AdapterWeights:
    """LoRA weights per module path in PEFT layout (``A [r, in]``, ``B [out, r]``), float32.

    Collective under FSDP: every rank must call it.
    """
    weights = {}
    for path, module in lora_modules(model).items():
        a = full_tensor(module.lora_A[adapter].weight.detach())
        b = full_tensor(module.lora_B[adapter].weight.detach())
        # copies: the caller gets values, never a view of the live parameters
        weights[path] = (a.float().cpu().numpy().copy(), b.float().cpu().numpy().copy())
    return weights


def set_adapter_weights(
    model: nn.Module, weights: AdapterWeights, source: str, adapter: str = ADAPTER_NAME
) -> None:
    """Overwrite the model's LoRA weights with PEFT-layout ``weights``."""
    modules = lora_modules(model)
    check_adapter_targets(weights, modules, source)
    for path, (a, b) in weights.items():
        module = modules[path]
        for param, value in (
            (module.lora_A[adapter].weight, a),
            (module.lora_B[adapter].weight, b),
        ):
            check_adapter_shape(source, path, value.shape, param.shape)
            copy_full_into(param, torch.from_numpy(np.ascontiguousarray(value, np.float32)))
