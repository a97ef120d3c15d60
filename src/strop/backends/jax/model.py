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

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strop.backends.jax import rope
from strop.backends.jax.attention import cached_attention, causal_attention
from strop.backends.jax.layers import Dense, Embedding, RMSNorm
from strop.backends.jax.moe import Routing, SparseMoeBlock, load_balancing_loss
from strop.backends.jax.rope import apply_rope, rope_inv_freq
from strop.batch.packing import PREFIX_STRIDE
from strop.errors import ModelError
from strop.models import LayerSpec, ModelSpec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def missing_features(spec: ModelSpec) -> list[str]:
    """What ``spec`` declares that this decoder does not build yet, in words."""
    if not spec.registered:
        return [f"model_type {spec.family!r} (no family of strop's declares it)"]
    checks = {
        "q/k norms over the whole projection": spec.qk_norm == "projection",
        f"{spec.norm_placement} norms": spec.norm_placement != "pre",
        "RMSNorm scaling by 1 + weight": spec.norm_weight_offset != 0.0,
        f"activation {spec.activation}": spec.activation != "silu",
        "an embedding scale": spec.embedding_scale is not None,
        "query_pre_attn_scalar": spec.query_scale is not None,
        "attention logit soft-capping": spec.attn_logit_softcap is not None,
        "final logit soft-capping": spec.final_logit_softcap is not None,
        "fused q/k/v or gate/up projections": spec.fused_qkv or spec.fused_gate_up,
        "MLP biases": spec.mlp_bias,
        "sliding-window attention": bool(spec.sliding_windows),
        "layers without RoPE": any(layer.rope is None for layer in spec.layers),
    }
    missing = [feature for feature, used in checks.items() if used]
    for layer in spec.layers:
        if layer.rope is None:
            continue
        if layer.rope.kind not in rope.KINDS:
            missing.append(f"rope type {layer.rope.kind!r}")
        if layer.rope.rotary_dim != spec.head_dim:
            missing.append("partial rotary embeddings")
    return list(dict.fromkeys(missing))


def check_model(spec: ModelSpec) -> None:
    """Refuse (:class:`ModelError`, one line) a model this decoder cannot build."""
    missing = missing_features(spec)
    if missing:
        raise ModelError(
            f"{spec.architecture} ({spec.family}) uses {', '.join(missing)}, which the jax "
            "backend does not implement yet: use backend=torch (docs/models.md)"
        )


class Attention(nnx.Module):
    """Grouped-query causal self-attention (plain dot-product, softmax in float32)."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, h, k, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        qkv = {"use_bias": spec.qkv_bias, **common}
        self.q_proj = Dense((e,), (h, d), ("embed",), ("heads", "head_dim"), **qkv)
        self.k_proj = Dense((e,), (k, d), ("embed",), ("kv_heads", "head_dim"), **qkv)
        self.v_proj = Dense((e,), (k, d), ("embed",), ("kv_heads", "head_dim"), **qkv)
        self.o_proj = Dense(
            (h, d), (e,), ("heads", "head_dim"), ("embed",), use_bias=spec.o_bias, **common
        )
        self.q_norm, self.k_norm = head_norms(spec, **common)
        self.inv_freq = tuple(rope_inv_freq(layer.rope).tolist())  # static data, not a weight
        self.num_groups = h // k

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        write_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attend ``x [B, L, E]`` under ``mask [B, L, Lk]``; returns (output, updated ``kv``).

        Without ``kv`` the keys are this call's L tokens (``Lk = L``). With ``kv`` (this
        layer's cached keys and values, ``[B, S, K, D]`` each) the new keys and values are
        first written at slots ``write_index .. write_index + L - 1`` and the queries attend
        over all S slots (``Lk = S``).
        """
        inv_freq = np.asarray(self.inv_freq, dtype=np.float32)
        q, k = self.q_proj(x), self.k_proj(x)  # [B, L, H, D], [B, L, K, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        v = self.v_proj(x)
        if kv is not None:
            k = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), write_index, 1)
            v = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), write_index, 1)
            kv = (k, v)
        b, length, heads, d = q.shape
        q = q.reshape(b, length, heads // self.num_groups, self.num_groups, d)
        attend = cached_attention if kv is not None else causal_attention
        return self.o_proj(attend(q, k, v, mask).reshape(b, length, heads, d)), kv


def head_norms(spec: ModelSpec, **common) -> tuple[RMSNorm | None, RMSNorm | None]:
    """Qwen3's RMSNorms on each query and key head over ``head_dim`` (before RoPE), or
    ``(None, None)`` for a decoder without them."""
    if spec.qk_norm != "head":
        return nnx.data(None), nnx.data(None)
    return tuple(RMSNorm(spec.head_dim, spec.rms_norm_eps, **common) for _ in "qk")


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, spec: ModelSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, m = spec.hidden_size, spec.intermediate_size
        common = {"use_bias": False, "dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.gate_proj = Dense((e,), (m,), ("embed",), ("mlp",), **common)
        self.up_proj = Dense((e,), (m,), ("embed",), ("mlp",), **common)
        self.down_proj = Dense((m,), (e,), ("mlp",), ("embed",), **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: attention and MLP (routed experts on a ``sparse``
    layer), each with a residual."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **common)
        self.self_attn = Attention(spec, layer, **common)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **common)
        self.mlp = SparseMoeBlock(spec, **common) if layer.sparse else MLP(spec, **common)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        real: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        write_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, Routing | None]:
        """The layer's output, its updated ``kv`` and, on a sparse layer, its routing of
        the ``real [B, L]`` tokens (:class:`~strop.backends.jax.moe.Routing`)."""
        attended, kv = self.self_attn(self.input_layernorm(x), positions, mask, kv, write_index)
        x = x + attended
        normed = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMoeBlock):
            out, routing = self.mlp(normed, real)
            return x + out, kv, routing
        return x + self.mlp(normed), kv, None


class DecoderStack(nnx.Module):
    """Embeddings, the stack of layers and the final norm (HF's ``model.*``)."""

    def __init__(self, spec: ModelSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size, **common)
        self.layers = nnx.List([DecoderLayer(spec, layer, **common) for layer in spec.layers])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **common)

    def __call__(
        self,
        ids: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        real: jax.Array,
        kv: Sequence[tuple[jax.Array, jax.Array]] | None = None,
        write_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[tuple[jax.Array, jax.Array], ...] | None, Routing | None]:
        """Final hidden states, the updated per-layer ``kv`` when one was given, and the
        sparse layers' routing of the ``real [B, L]`` tokens summed (``None``: none)."""
        x = self.embed_tokens(ids)
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
    slot. Positions (for RoPE) are separate from slots: by default each row counts
    positions over its real tokens only, as in the full-sequence path, so a row's
    outputs do not depend on how much padding it got.

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
    normed ``hidden [B, L, E]``, the updated :class:`KVCache` when one was passed, and,
    for routed experts, the router's load-balancing loss over the real tokens
    (:func:`~strop.backends.jax.moe.load_balancing_loss`; ``None`` without experts)."""

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
        segments, prefixes = attention_mask % PREFIX_STRIDE, attention_mask // PREFIX_STRIDE
        attention_mask = segments.astype(jnp.bool_)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0)
            if cache is not None:
                positions = positions + cache.mask.sum(axis=-1, keepdims=True, dtype=jnp.int32)
        length = input_ids.shape[-1]
        if cache is None:
            causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
            # a real query sees its own segment's keys (a 0/1 mask: every real key) and those
            # of the shared prompt it names (packed rollouts of one prompt)
            own = (
                (segments[:, :, None] == segments[:, None, :])
                | (prefixes[:, :, None] == segments[:, None, :])
                | ~attention_mask[:, :, None]
            )
            mask = causal[None, :, :] & attention_mask[:, None, :] & own  # [B, Lq, Lk]
            hidden, _, routing = self.model(input_ids, positions, mask, attention_mask)
        else:
            valid = jax.lax.dynamic_update_slice_in_dim(
                cache.mask, attention_mask, cache.index, axis=1
            )
            query_slots = cache.index + jnp.arange(length)
            causal = jnp.arange(valid.shape[1])[None, :] <= query_slots[:, None]  # [Lq, S]
            mask = causal[None, :, :] & valid[:, None, :]  # [B, Lq, S]
            hidden, layers, routing = self.model(
                input_ids, positions, mask, attention_mask, cache.layers, cache.index
            )
            cache = KVCache(layers, valid, cache.index + length)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(kept)
        else:
            logits = self.lm_head(kept)
        aux_loss = None if routing is None else load_balancing_loss(routing)
        return CausalLMOutput(logits.astype(jnp.float32), hidden, cache, aux_loss)
