"""LoRA on the NNX model, injected by Qwix, and the one filter that says what trains.

Targets are chosen by :func:`strop.lora_targets.match_targets` (``re.fullmatch`` on
HF-style dotted module paths, as PEFT does) and handed to Qwix as an exact alternation
of its own ``/``-joined paths. Qwix intercepts each targeted
``jnp.einsum`` over a flat ``[in, out]`` kernel and adds ``kernel_lora_a`` (``[in, r]``) and
``kernel_lora_b`` (``[r, out]``) as ``nnx.LoRAParam`` next to the kernel, scaled by alpha /
rank: PEFT's ``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` transposed.
Their initial values are not Qwix's: :func:`apply_lora` overwrites them with
:mod:`strop.lora_init`'s (a function of seed, module path and shape, the same on the
torch backend), placed with each parameter's sharding.
"""

from __future__ import annotations

import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from strop.backends.jax.layers import Dense
from strop.backends.jax.model import CausalLM
from strop.backends.jax.moe import Experts
from strop.backends.jax.sharding import to_host
from strop.config import Config, LoraConfig
from strop.errors import ConfigError
from strop.io.peft import check_adapter_shape, check_adapter_targets, read_adapter_for
from strop.lora_init import adapters as initial_adapters
from strop.lora_targets import match_targets
from strop.objectives.roles import RolePlan

logger = logging.getLogger(__name__)

# nnx.LoRAParam subclasses nnx.Param: "base weights" must exclude it explicitly.
BASE_WEIGHTS = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
NF4_BLOCK = 64  # inputs per nf4 scale, as bitsandbytes' default blocksize


def trainable_filter(lora_enabled: bool) -> nnx.filterlib.Filter:
    """What trains: only LoRA params with LoRA on, every param with it off.

    The single source for the optimizer's ``wrt``, the gradient ``DiffState``, the train
    step's split, optimizer-state sharding and checkpoint content.
    """
    return nnx.LoRAParam if lora_enabled else nnx.Param


def dense_modules(model: CausalLM) -> dict[str, Dense]:
    """Every linear LoRA may adapt, by HF-style dotted path: the spec's linears
    (:meth:`~strop.models.ModelSpec.linear_shape`), the ones PEFT finds in transformers'
    model; a sparse layer's router is a :class:`Dense` here but not a linear there."""
    modules = {
        ".".join(map(str, path)): module
        for path, module in nnx.iter_modules(model)
        if isinstance(module, Dense)
    }
    return {path: m for path, m in modules.items() if model.spec.linear_shape(path) is not None}


def refuse_expert_targets(model: CausalLM, patterns: list[str]) -> None:
    """Refuse (one line) a ``lora.target_modules`` pattern naming routed experts (the
    module ``model.layers.N.mlp.experts``, one module holding every expert, as in
    transformers): Qwix's LoRA intercepts ``einsum`` and ``dot_general``, not the
    ``jax.lax.ragged_dot`` the experts run on, so it cannot adapt them."""
    experts = [
        ".".join(map(str, path))
        for path, module in nnx.iter_modules(model)
        if isinstance(module, Experts)
    ]
    for pattern in patterns:
        named = [path for path in experts if re.fullmatch(pattern, path)]
        if named:
            raise ConfigError(
                f"lora.target_modules: pattern {pattern!r} names routed experts ({named[0]}), "
                "which the jax backend cannot adapt (Qwix's LoRA does not intercept "
                "jax.lax.ragged_dot): target the attention and dense MLP projections"
            )


def check_supported(config: LoraConfig) -> None:
    """Refuse, before anything loads, the LoRA settings this backend lacks (dropout)."""
    if config.dropout > 0:
        raise ConfigError("lora.dropout: the jax backend supports only 0 for now")


def apply_lora(model: CausalLM, config: LoraConfig, seed: int) -> CausalLM:
    """Return ``model`` with LoRA adapters on the modules ``config.target_modules`` selects.

    Works on a model already sharded on a mesh: adapters are created next to their
    kernels with shardings derived from the kernel's. Base weights are shared, not copied.
    The adapters start from :func:`strop.lora_init.adapters` for ``seed`` (A uniform in
    ±1/sqrt(in), B zero), the values the torch backend starts from. They are float32 over
    any base, so that updates under a bfloat16 ulp still count, and compute in the model's
    dtype (:class:`~strop.backends.jax.layers.Dense` casts them for each call).
    """
    refuse_expert_targets(model, config.target_modules)
    targets = match_targets(config.target_modules, list(dense_modules(model)))
    qwix_paths = "|".join(re.escape(path.replace(".", "/")) for path in targets)
    quantized = config.base_quantization != "none"
    provider = qwix.LoraProvider(
        module_path=qwix_paths, rank=config.rank, alpha=config.alpha, dropout=config.dropout,
        # QLoRA: Qwix quantizes each targeted kernel at the call below and keeps only the
        # quantized arrays (nf4 in blocks of 64 inputs, as bitsandbytes; int8 per channel)
        weight_qtype=config.base_quantization if quantized else None,
        tile_size=NF4_BLOCK if config.base_quantization == "nf4" else None,
    )  # fmt: skip
    dummy_ids = jnp.zeros((1, 1), dtype=jnp.int32)
    model = qwix.apply_lora_to_model(model, provider, dummy_ids, rngs=nnx.Rngs(seed))
    adapted = {path: m for path, m in dense_modules(model).items() if hasattr(m, "kernel_lora_a")}
    for module in adapted.values():  # float32 over any base (Qwix makes them in its dtype)
        for variable in (module.kernel_lora_a, module.kernel_lora_b):
            variable.set_value(variable.get_value().astype(jnp.float32))
    shapes = {p: (math.prod(m.in_shape), math.prod(m.out_shape)) for p, m in adapted.items()}
    set_adapter_weights(model, initial_adapters(seed, shapes, config.rank), "the initial adapters")
    return model


def with_adapters_merged(model: CausalLM, config: LoraConfig) -> CausalLM:
    """``model`` with each adapter folded into its kernel (``W + alpha / rank * A @ B``),
    as a copy; ``model`` itself when LoRA is off (nothing to fold)."""
    if not config.enabled:
        return model
    merged = nnx.clone(model)
    scale = config.alpha / config.rank
    for module in dense_modules(merged).values():
        lora_a = getattr(module, "kernel_lora_a", None)
        if lora_a is None:
            continue
        delta = lora_a.get_value() @ module.kernel_lora_b.get_value()
        if isinstance(module.kernel, nnx.Variable):
            kernel = module.kernel.get_value()
            module.kernel.set_value((kernel + scale * delta).astype(kernel.dtype))
        else:  # a quantized base: dequantized (to its weights' dtype), then merged
            qvalue = module.kernel.array.qvalue
            qarray = jax.tree.map(
                nnx.Variable.get_value, module.kernel.array,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )  # fmt: skip
            kernel = qwix.dequantize(qarray)
            merged_kernel = (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)
            module.kernel = nnx.Param(
                merged_kernel, out_sharding=qvalue.out_sharding, eager_sharding=False
            )
    return merged


def adapter_weights(model: CausalLM) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """LoRA weights per module path as PEFT lays them out: ``A [r, in]``, ``B [out, r]``
    (the transposes of ``kernel_lora_a [in, r]`` and ``kernel_lora_b [r, out]``)."""
    weights = {}
    for path, module in dense_modules(model).items():
        lora_a = getattr(module, "kernel_lora_a", None)
        if lora_a is None:
            continue
        a = to_host(lora_a.get_value()).astype(np.float32)
        b = to_host(module.kernel_lora_b.get_value()).astype(np.float32)
        weights[path] = (a.T, b.T)
    return weights


def set_adapter_weights(
    model: CausalLM, weights: dict[str, tuple[np.ndarray, np.ndarray]], source: str
) -> None:
    """Overwrite the model's LoRA weights with PEFT-layout ``weights`` (see above)."""
    modules = {p: m for p, m in dense_modules(model).items() if hasattr(m, "kernel_lora_a")}
    check_adapter_targets(weights, modules, source)
    for path, (a, b) in weights.items():
        module = modules[path]
        n_in, n_out = math.prod(module.in_shape), math.prod(module.out_shape)
        rank = module.kernel_lora_a.get_value().shape[-1]
        for variable, value, peft_shape in (
            (module.kernel_lora_a, a, (rank, n_in)),
            (module.kernel_lora_b, b, (n_out, rank)),
        ):
            # Compared in the PEFT layout (as the torch backend does) before the transpose.
            check_adapter_shape(source, path, value.shape, peft_shape)
            current = variable.get_value()
            new = value.T
            variable.set_value(jnp.asarray(new, dtype=current.dtype, device=current.sharding))


def initial_reference(
    graph: nnx.GraphDef, actor: nnx.State, frozen: nnx.State, config: Config, plan: RolePlan
):
    """The PPO reference's trainable-shaped part, beside the actor's ``(graph, actor,
    frozen)``, as ``plan.reference`` says: a zero adapter (``base``), the SFT adapter
    ``plan.reference_adapter`` (``adapter``), or (full fine-tuning, ``copy``) a copy of
    ``actor``."""
    if plan.reference == "copy":
        return jax.tree.map(jnp.copy, actor)
    reference = jax.tree.map(jnp.zeros_like, actor)
    path = plan.reference_adapter
    if plan.reference == "adapter":
        module = nnx.merge(graph, reference, frozen)
        set_adapter_weights(
            module, read_adapter_for(path, config.lora, config.model.path), str(path)
        )
        reference = nnx.state(module, nnx.LoRAParam)
        logger.info("reference policy: the adapter at %s (frozen)", path)
    return reference
