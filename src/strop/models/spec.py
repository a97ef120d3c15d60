""":class:`ModelSpec`: a decoder's architecture, as its family (``strop.models.families``)
parsed it from ``config.json``. One dataclass for every family: the common decoder's sizes,
and the declared ways a family's decoder differs from it (norm kind and placement, q/k
norms, biases, activation, embedding scale, per-layer sliding windows and RoPE, partial
rotary, soft-capping, fused projections, routed experts). The backends build from these
fields, never from the family's name.

Backend-neutral: nothing here imports an array framework.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from strop.models.rope import Rope

NormPlacement = Literal["pre", "post", "sandwich"]
"""Where a layer's RMSNorms sit. ``pre`` (Llama): before attention and before the MLP.
``post`` (OLMo 2): after each, on the sub-layer's output, before the residual add.
``sandwich`` (Gemma 3): both, four norms a layer."""

QkNorm = Literal["none", "head", "projection"]
"""RMSNorm on queries and keys before RoPE: per head over ``head_dim`` (Qwen3, Gemma 3),
or over the whole projection, ``heads x head_dim`` (OLMo 2)."""

_LAYER_LINEAR = re.compile(r"model\.layers\.(?P<layer>0|[1-9][0-9]{0,5})\.(?P<linear>[\w.]+)")


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is: its attention window (``None``: full causal attention,
    else a query sees the ``sliding_window`` latest positions, itself included), its RoPE
    (``None``: no position encoding, SmolLM3's NoPE layers), and whether its MLP is routed
    experts (``sparse``)."""

    sliding_window: int | None
    rope: Rope | None
    sparse: bool = False


@dataclass(frozen=True)
class MoeSpec:
    """Routed experts (Qwen3-MoE): ``num_experts`` MLPs of ``intermediate_size``, the
    ``top_k`` a token goes to (their softmax weights renormalised when ``norm_topk_prob``),
    and the load-balancing loss's weight in training (``router_aux_loss_coef``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    router_aux_loss_coef: float


@dataclass(frozen=True)
class ModelSpec:
    """The architecture of a decoder-only causal LM, parsed from a HF ``config.json`` by
    its family. ``raw`` keeps the original config so a saved checkpoint round-trips."""

    family: str
    """The config's ``model_type`` (``qwen3``, ``gemma3_text``, ...)."""
    architecture: str
    """The transformers class that builds it (``Qwen3ForCausalLM``)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    layers: tuple[LayerSpec, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: QkNorm = "none"
    norm_placement: NormPlacement = "pre"
    norm_weight_offset: float = 0.0
    """Gemma's RMSNorm scales by ``1 + weight`` (1.0) where Llama's scales by ``weight``."""
    norm_scale_in_float32: bool = False
    """OLMo 2 and Gemma 3 scale the normalised activations in float32 and cast the product
    to the compute dtype; Llama casts them first and scales in the compute dtype (the two
    agree in float32, not in bfloat16)."""
    activation: Literal["silu", "gelu_tanh"] = "silu"
    embedding_scale: float | None = None
    """Gemma multiplies the embeddings by ``sqrt(hidden_size)`` (in the compute dtype)."""
    query_scale: float | None = None
    """Attention's ``q k^T`` multiplier; ``None``: ``head_dim ** -0.5``."""
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    fused_qkv: bool = False
    """Phi-3: one ``qkv_proj`` (q, then k, then v rows) instead of three projections."""
    fused_gate_up: bool = False
    """Phi-3: one ``gate_up_proj`` (gate rows, then up rows)."""
    moe: MoeSpec | None = None
    registered: bool = True
    """False for a decoder no family of strop's declares: its fields are read from the
    common keys, the torch backend builds transformers' class for it, JAX refuses it."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def scale(self) -> float:
        """Attention's ``q k^T`` multiplier."""
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the layers (empty: every layer attends fully)."""
        return tuple(
            sorted({layer.sliding_window for layer in self.layers if layer.sliding_window})
        )

    def layer_linears(self, layer: int) -> dict[str, tuple[int, int]]:
        """Layer ``layer``'s linear layers: HF name under ``model.layers.N.`` -> the
        ``nn.Linear.weight`` shape ``(out, in)``. What LoRA may target and a PEFT adapter
        must fit (A ``[r, in]``, B ``[out, r]``). Routed experts' weights are not linears
        here: transformers keeps them as 3-D parameters."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused_qkv:
            linears = {"self_attn.qkv_proj": (q + 2 * kv, h)}
        else:
            linears = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
                       "self_attn.v_proj": (kv, h)}  # fmt: skip
        linears["self_attn.o_proj"] = (h, q)
        if self.layers[layer].sparse:
            return linears
        if self.fused_gate_up:
            linears["mlp.gate_up_proj"] = (2 * i, h)
        else:
            linears |= {"mlp.gate_proj": (i, h), "mlp.up_proj": (i, h)}
        linears["mlp.down_proj"] = (h, i)
        return linears

    def linear_shape(self, module: str) -> tuple[int, int] | None:
        """The HF ``nn.Linear.weight`` shape ``(out, in)`` of ``module`` (a dotted path such
        as ``model.layers.3.self_attn.q_proj``, or ``lm_head``), or ``None`` if the model has
        no such linear layer."""
        if module == "lm_head":
            return (self.vocab_size, self.hidden_size)
        found = _LAYER_LINEAR.fullmatch(module)
        if found is None or int(found["layer"]) >= self.num_layers:
            return None
        return self.layer_linears(int(found["layer"])).get(found["linear"])

    def linear_paths(self) -> list[str]:
        """Every linear's module path, in model order (``lm_head`` last)."""
        paths = [
            f"model.layers.{i}.{name}"
            for i in range(self.num_layers)
            for name in self.layer_linears(i)
        ]
        return [*paths, "lm_head"]
