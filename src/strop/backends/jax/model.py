"""The decoder of every family the JAX backend builds, in Flax NNX, numerically equal to
``transformers``: one decoder made of shared blocks, configured by the
:class:`~strop.models.ModelSpec` its family parsed (never by the family's name).
:func:`check_model` refuses, in one line, a spec declaring what these blocks do not do yet.

Module and attribute names mirror the Hugging Face ones (``model.layers.3.self_attn.q_proj``),
so module paths read the same as in PEFT and weight names map one to one. Each weight
carries logical axis names in its ``out_sharding`` metadata; ``sharding.py`` maps them to
the mesh. Projections are ``jnp.einsum`` over flat 2-D kernels (``[embed, heads * head_dim]``
for q, HF's ``nn.Linear`` weight transposed), the form Qwix intercepts for LoRA.

Shapes: B batch, L sequence, E hidden, H heads, K kv heads, D head dim, V vocab, S cache
slots.

Incremental decoding: pass a :class:`KVCache` to :meth:`CausalLM.__call__` and get it back
updated in the output. Without one, the forward is the plain full-sequence (training) path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from strop.backends.jax import rope
from strop.backends.jax.attention import (
    AttentionMask,
    cache_mask,
    cached_attention,
    causal_attention,
    sequence_mask,
)
from strop.backends.jax.layers import Dense, Embedding, RMSNorm
from strop.backends.jax.moe import Routing, SparseMoeBlock, load_balancing_loss
from strop.backends.jax.rope import apply_rope, rope_cos_sin
from strop.batch.packing import PREFIX_STRIDE
from strop.errors import ModelError
from strop.models import LayerSpec, ModelSpec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
"""The MLP's gate activation, by :attr:`ModelSpec.activation`."""

NORMS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
}  # fmt: skip
"""A layer's RMSNorms by :attr:`ModelSpec.norm_placement`, under their HF names: on the
attention's input, on its output, on the MLP's input, on its output (``None``: none)."""


def missing_features(spec: ModelSpec) -> list[str]:
    """What ``spec`` declares that this decoder does not build yet (a RoPE kind), in words."""
    if not spec.registered:
        return [f"model_type {spec.family!r} (no family of strop's declares it)"]
    kinds = [layer.rope.kind for layer in spec.layers if layer.rope is not None]
    return [f"rope type {kind!r}" for kind in dict.fromkeys(kinds) if kind not in rope.KINDS]


def check_model(spec: ModelSpec) -> None:
    """Refuse (:class:`ModelError`, one line) a model this decoder cannot build."""
    missing = missing_features(spec)
    if missing:
        raise ModelError(
            f"{spec.architecture} ({spec.family}) uses {', '.join(missing)}, which the jax "
            "backend does not implement yet: use backend=torch (docs/models.md)"
        )


def qk_norms(spec: ModelSpec, *, dtype, param_dtype, rngs) -> tuple[RMSNorm | None, ...]:
    """The RMSNorms on queries and keys (HF's ``q_norm``, ``k_norm``) ``spec.qk_norm``
    declares: none, per head (weights ``[D]``, Qwen3) or over the whole projection
    (``[H * D]`` and ``[K * D]``, OLMo 2)."""
    if spec.qk_norm == "none":
        return None, None
    h, k, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    sizes, axis = ((d, d), "head_dim") if spec.qk_norm == "head" else ((h * d, k * d), "norm")
    return tuple(
        RMSNorm(size, spec.rms_norm_eps, axis=axis, offset=spec.norm_weight_offset,
                scale_in_float32=spec.norm_scale_in_float32, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs)
        for size in sizes
    )  # fmt: skip


class Attention(nnx.Module):
    """Grouped-query causal self-attention (plain dot-product, softmax in float32), over
    the layer's sliding window if it has one, with the q/k norms and the RoPE (or none:
    NoPE) its spec and layer declare.

    The queries, keys and values come from three projections (``q_proj``, ``k_proj``,
    ``v_proj``) or, where the spec says ``fused_qkv`` (Phi-3), from one ``qkv_proj`` whose
    output is the q heads, then the k heads, then the v heads, as transformers' layout:
    one Dense module, so LoRA adapts it as one linear, as PEFT does. Its output dim is not
    sharded over ``tensor``: contiguous slices of it cut across the q/k/v boundaries, so
    no split into whole heads leaves each device its own q, k and v heads.
    """

    def __init__(self, spec: ModelSpec, layer: LayerSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, h, k, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        qkv = {"use_bias": spec.qkv_bias, **common}
        self.fused_qkv = spec.fused_qkv
        if spec.fused_qkv:
            self.qkv_proj = Dense((e,), (h + 2 * k, d), ("embed",), (None, "head_dim"), **qkv)
        else:
            self.q_proj = Dense((e,), (h, d), ("embed",), ("heads", "head_dim"), **qkv)
            self.k_proj = Dense((e,), (k, d), ("embed",), ("kv_heads", "head_dim"), **qkv)
            self.v_proj = Dense((e,), (k, d), ("embed",), ("kv_heads", "head_dim"), **qkv)
        self.o_proj = Dense(
            (h, d), (e,), ("heads", "head_dim"), ("embed",), use_bias=spec.o_bias, **common
        )
        self.q_norm, self.k_norm = qk_norms(spec, **common)
        self.qk_norm = spec.qk_norm
        self.rope = layer.rope  # static: the tables are computed when traced; None: NoPE
        self.num_heads, self.num_groups = h, h // k
        self.sliding_window = layer.sliding_window
        self.scale, self.softcap = spec.scale, spec.attn_logit_softcap

    def project_qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``[B, L, H, D]``, keys and values ``[B, L, K, D]`` of ``x [B, L, E]``."""
        if not self.fused_qkv:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        fused = self.qkv_proj(x)  # [B, L, H + 2K, D]
        h, k = self.num_heads, self.num_heads // self.num_groups
        return fused[:, :, :h], fused[:, :, h : h + k], fused[:, :, h + k :]

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: AttentionMask,
        kv: tuple[jax.Array, jax.Array] | None = None,
        write_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attend ``x [B, L, E]`` under ``mask`` (``[B, L, Lk]`` within this layer's window);
        returns (output, updated ``kv``).

        Without ``kv`` the keys are this call's L tokens (``Lk = L``). With ``kv`` (this
        layer's cached keys and values, ``[B, S, K, D]`` each) the new keys and values are
        first written at slots ``write_index .. write_index + L - 1`` and the queries attend
        over all S slots (``Lk = S``).
        """
        q, k, v = self.project_qkv(x)
        q, k = self._qk_normed(self.q_norm, q), self._qk_normed(self.k_norm, k)
        if self.rope is not None:
            cos, sin = rope_cos_sin(self.rope, positions)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), write_index, 1)
            v = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), write_index, 1)
            kv = (k, v)
        b, length, heads, d = q.shape
        q = q.reshape(b, length, heads // self.num_groups, self.num_groups, d)
        attend = cached_attention if kv is not None else causal_attention
        out = attend(q, k, v, mask.within(self.sliding_window), scale=self.scale,
                     softcap=self.softcap)  # fmt: skip
        return self.o_proj(out.reshape(b, length, heads, d)), kv

    def _qk_normed(self, norm: RMSNorm | None, x: jax.Array) -> jax.Array:
        """``x [B, L, N, D]`` through ``norm``: per head, or over its N x D values at once."""
        if norm is None:
            return x
        if self.qk_norm == "head":
            return norm(x)
        return norm(x.reshape(*x.shape[:-2], -1)).reshape(x.shape)


class MLP(nnx.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, ``act`` the spec's activation (SwiGLU for
    silu, GeGLU for gelu_tanh), the three with biases under ``mlp_bias``.

    ``gate_proj`` and ``up_proj``, or, where the spec says ``fused_gate_up`` (Phi-3), one
    ``gate_up_proj`` whose output is the gate units then the up units (transformers'
    layout; one Dense module, so LoRA adapts it as one linear, as PEFT does). Its output
    dim is not sharded over ``tensor``: a contiguous slice of it holds gate units or up
    units, never the matching pairs ``act(gate) * up`` needs.
    """

    def __init__(self, spec: ModelSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, m = spec.hidden_size, spec.intermediate_size
        common = {
            "use_bias": spec.mlp_bias,
            "dtype": dtype,
            "param_dtype": param_dtype,
            "rngs": rngs,
        }
        self.fused_gate_up = spec.fused_gate_up
        if spec.fused_gate_up:
            self.gate_up_proj = Dense((e,), (2, m), ("embed",), (None, "mlp"), **common)
        else:
            self.gate_proj = Dense((e,), (m,), ("embed",), ("mlp",), **common)
            self.up_proj = Dense((e,), (m,), ("embed",), ("mlp",), **common)
        self.down_proj = Dense((m,), (e,), ("mlp",), ("embed",), **common)
        self.activation = spec.activation

    def project_gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The gate and up projections ``[B, L, M]`` of ``x [B, L, E]``."""
        if not self.fused_gate_up:
            return self.gate_proj(x), self.up_proj(x)
        fused = self.gate_up_proj(x)  # [B, L, 2, M]
        return fused[..., 0, :], fused[..., 1, :]

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.project_gate_up(x)
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)


class DecoderLayer(nnx.Module):
    """Transformer block: attention and MLP (routed experts on a ``sparse`` layer), each
    with a residual, and RMSNorms where the spec places them (:data:`NORMS`)."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.norms = NORMS[spec.norm_placement]
        for name in filter(None, self.norms):
            norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, offset=spec.norm_weight_offset,
                           scale_in_float32=spec.norm_scale_in_float32, **common)  # fmt: skip
            setattr(self, name, norm)
        self.self_attn = Attention(spec, layer, **common)
        self.mlp = SparseMoeBlock(spec, **common) if layer.sparse else MLP(spec, **common)

    def _norm(self, name: str | None, x: jax.Array) -> jax.Array:
        return x if name is None else getattr(self, name)(x)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: AttentionMask,
        real: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        write_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, Routing | None]:
        """Output, updated ``kv`` and a sparse layer's routing of the ``real [B, L]`` tokens."""
        attention_in, attention_out, mlp_in, mlp_out = self.norms
        attended, kv = self.self_attn(self._norm(attention_in, x), positions, mask, kv, write_index)
        x = x + self._norm(attention_out, attended)
        routing = None
        if isinstance(self.mlp, SparseMoeBlock):
            out, routing = self.mlp(self._norm(mlp_in, x), real)
        else:
            out = self.mlp(self._norm(mlp_in, x))
        return x + self._norm(mlp_out, out), kv, routing


class DecoderStack(nnx.Module):
    """Embeddings, the stack of layers and the final norm (HF's ``model.*``)."""

    def __init__(self, spec: ModelSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, **common)
        self.layers = nnx.List([DecoderLayer(spec, layer, **common) for layer in spec.layers])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, offset=spec.norm_weight_offset,
                            scale_in_float32=spec.norm_scale_in_float32, **common)  # fmt: skip
        self.embedding_scale = spec.embedding_scale

    def __call__(
        self,
        ids: jax.Array,
        positions: jax.Array,
        mask: AttentionMask,
        real: jax.Array,
        kv: Sequence[tuple[jax.Array, jax.Array]] | None = None,
        write_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[tuple[jax.Array, jax.Array], ...] | None, Routing | None]:
        """Final hidden states, the updated per-layer ``kv`` when one was given, and the
        sparse layers' routing of the ``real [B, L]`` tokens summed (``None``: none)."""
        x = self.embed_tokens(ids)
        if self.embedding_scale is not None:  # Gemma: the scale rounded to the compute dtype
            x = x * jnp.asarray(self.embedding_scale, dtype=x.dtype)
        updated, routed = [], None
        for layer, layer_kv in zip(self.layers, kv or (None,) * len(self.layers), strict=True):
            x, layer_kv, routing = layer(x, positions, mask, real, layer_kv, write_index)
            updated.append(layer_kv)
            routed = routing.plus(routed) if routing is not None else routed
        return self.norm(x), None if kv is None else tuple(updated), routed


class KVCache(NamedTuple):
    """Preallocated keys and values of every layer, for incremental decoding.

    The cache has S slots per row, shared by all rows: a forward of ``L`` tokens writes
    slots ``index .. index + L - 1`` of every row and moves ``index`` on by ``L``. Ragged
    rows are handled by padding (e.g. left-padded prompts), which ``mask`` marks as not
    real: a query attends to slot ``s`` iff ``mask[b, s]`` and ``s`` is not after its own
    slot (and, in a sliding-window layer, fewer than ``window`` real slots lie after ``s``
    up to its own: :func:`~strop.backends.jax.attention.cache_mask`). Positions (for
    RoPE) are separate from slots: by default each row counts positions over its real
    tokens only, as in the full-sequence path, so a row's outputs do not depend on how
    much padding it got. Every layer keeps all S slots, sliding ones too.

    Attributes:
      layers: per layer ``(keys, values)``, each ``[B, S, K, D]`` in the compute dtype;
        keys are stored after RoPE.
      mask: ``[B, S] bool``: the slot holds a real token (False for padding and for slots
        not written yet).
      index: ``[] int32``: the next slot to write.
    """

    layers: tuple[tuple[jax.Array, jax.Array], ...]
    mask: jax.Array
    index: jax.Array


class CausalLMOutput(NamedTuple):
    """``logits [B, L, V]`` (float32; ``[B, logits_to_keep, V]`` when asked), the final
    normed ``hidden [B, L, E]``, the updated :class:`KVCache` when one was passed, and the
    router's load-balancing loss (:mod:`~strop.backends.jax.moe`; ``None``: no experts)."""

    logits: jax.Array
    hidden: jax.Array
    cache: KVCache | None = None
    aux_loss: jax.Array | None = None


class CausalLM(nnx.Module):
    """Decoder plus LM head (separate, or tied to the embeddings)."""

    def __init__(self, spec: ModelSpec, *, dtype="float32", param_dtype="float32", rngs=None):
        check_model(spec)
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        common = {"dtype": DTYPES[dtype], "param_dtype": DTYPES[param_dtype], "rngs": rngs}
        self.spec = spec
        self.dtype = DTYPES[dtype]
        self.model = DecoderStack(spec, **common)
        self.lm_head = nnx.data(None)  # tied: logits come from the embedding table
        if not spec.tie_word_embeddings:
            self.lm_head = Dense((spec.hidden_size,), (spec.vocab_size,), ("embed",), ("vocab",),
                                 use_bias=False, **common)  # fmt: skip

    def init_cache(self, batch: int, slots: int) -> KVCache:
        """An empty :class:`KVCache` of ``slots`` slots per row (zeros, nothing valid)."""
        shape = (batch, slots, self.spec.num_kv_heads, self.spec.head_dim)
        layers = tuple(
            (jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
            for _ in range(self.spec.num_layers)
        )
        return KVCache(layers, jnp.zeros((batch, slots), jnp.bool_), jnp.zeros((), jnp.int32))

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits ``[..., V]`` of final normed hidden states ``[..., E]`` (the LM head,
        or the tied embeddings, an adapter included; then the final soft-cap, Gemma's)."""
        head = self.model.embed_tokens.attend if self.lm_head is None else self.lm_head
        logits, cap = head(hidden).astype(jnp.float32), self.spec.final_logit_softcap
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """Forward a ``[B, L]`` batch.

        ``attention_mask`` (1 = real token) hides padding from attention; without
        ``positions`` each row counts positions from its first real token, so left and
        right padding give the same result on real tokens. Without ``cache`` it may also
        hold segment ids (1, 2, ... : rollouts packed one after another into a row, see
        :mod:`strop.batch.packing`, with their ``positions``): a token then attends only
        within its own segment, as if each segment were a row of its own, and within the
        shared prompt it sees (``segment + PREFIX_STRIDE * prefix``).

        With ``cache`` the L tokens are written into it at its ``index`` and attend to
        everything cached before them (see :class:`KVCache`); default positions then
        continue each row's count of real tokens. ``logits_to_keep > 0`` computes logits
        for the last that many positions only (a prefill needs just the last one).
        """
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        real = (attention_mask % PREFIX_STRIDE).astype(jnp.bool_)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(real, axis=-1) - 1, 0)
            if cache is not None:
                positions = positions + cache.mask.sum(axis=-1, keepdims=True, dtype=jnp.int32)
        if cache is None:
            mask = sequence_mask(attention_mask, positions)
            hidden, _, routing = self.model(input_ids, positions, mask, real)
        else:
            valid = jax.lax.dynamic_update_slice_in_dim(cache.mask, real, cache.index, axis=1)
            mask = cache_mask(valid, cache.index, input_ids.shape[-1])
            hidden, layers, routing = self.model(
                input_ids, positions, mask, real, cache.layers, cache.index
            )
            cache = KVCache(layers, valid, cache.index + input_ids.shape[-1])
        logits = self.logits_from_hidden(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        aux_loss = None if routing is None else load_balancing_loss(routing)
        return CausalLMOutput(logits, hidden, cache, aux_loss)
