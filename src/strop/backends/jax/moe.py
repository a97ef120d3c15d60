"""Routed experts for :mod:`strop.backends.jax.model`'s decoder (the sparse layers of
Qwen3-MoE), equal to transformers' ``Qwen3MoeSparseMoeBlock``, and the router's
load-balancing loss, equal to its ``load_balancing_loss_func``.

A token goes to the ``top_k`` experts its router ranks highest: a softmax in float32 over
the router's ``num_experts`` logits, the ``top_k`` largest probabilities (renormalised to
sum to 1 when ``norm_topk_prob``), cast back to the compute dtype, weigh the experts'
outputs. Each expert is a SwiGLU MLP; their kernels are stacked on a leading ``expert``
axis, the ``N * top_k`` (token, expert) pairs are sorted by expert and each projection is
one grouped matmul (``jax.lax.ragged_dot``) over the experts' contiguous groups. On GPU and
TPU that is a grouped kernel, the work of the routed pairs only; XLA:CPU gets JAX's
fallback, a masked dense product with every expert (``X`` times the work: fine for tests
and tiny models, not for training a large MoE on CPU).

Shapes: N tokens (``B * L``), H hidden, X experts, K ``top_k``, I the experts' width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from strop.backends.jax.layers import Dense, _param
from strop.models import ModelSpec


class Routing(NamedTuple):
    """What the load-balancing loss needs of the sparse layers' routing, summed over their
    real tokens (padding left out, as transformers' ``attention_mask`` does): ``assigned``
    ``[X]``, the (token, expert) pairs each expert got; ``probability`` ``[X]`` (float32),
    the router probabilities each expert got; ``tokens`` ``[]``, the tokens routed."""

    assigned: jax.Array
    probability: jax.Array
    tokens: jax.Array

    def plus(self, other: Routing | None) -> Routing:
        """The sums of two layers' routing (``self`` when ``other`` is ``None``)."""
        return self if other is None else Routing(*jax.tree.map(jnp.add, tuple(self), tuple(other)))


def load_balancing_loss(routing: Routing) -> jax.Array:
    """Switch Transformer's auxiliary loss (eqs. 4-6), transformers' ``load_balancing_loss_func``
    over every sparse layer pooled: ``X * sum_e f_e * P_e``, with ``f_e`` the pairs routed to
    expert ``e`` per token and ``P_e`` its mean router probability. ``top_k`` when the
    routing is uniform, more the more it favours some experts; only ``P`` carries a
    gradient (to the router)."""
    tokens = jnp.maximum(routing.tokens, 1.0)
    share = routing.assigned / tokens
    mean_probability = routing.probability / tokens
    return routing.assigned.shape[-1] * jnp.sum(share * mean_probability)


class Experts(nnx.Module):
    """``X`` SwiGLU MLPs, ``down(silu(gate(x)) * up(x))``, as stacked kernels: ``gate_proj``
    and ``up_proj`` ``[X, H, I]``, ``down_proj`` ``[X, I, H]`` (each expert's HF
    ``nn.Linear.weight`` transposed, stacked in expert order)."""

    def __init__(self, hidden: int, width: int, experts: int, *, dtype, param_dtype, rngs):
        init = nnx.initializers.normal(0.02)
        into, out_of = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
        self.gate_proj = _param(rngs, (experts, hidden, width), into, param_dtype, init)
        self.up_proj = _param(rngs, (experts, hidden, width), into, param_dtype, init)
        self.down_proj = _param(rngs, (experts, width, hidden), out_of, param_dtype, init)
        self.dtype = dtype

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """``x [M, H]``: rows sorted by expert, ``group_sizes[e]`` of them for expert ``e``
        (``sum = M``); returns each row through its expert, ``[M, H]``."""

        def project(rows: jax.Array, kernel: nnx.Param) -> jax.Array:
            return jax.lax.ragged_dot(rows, kernel[...].astype(self.dtype), group_sizes)

        hidden = jax.nn.silu(project(x, self.gate_proj)) * project(x, self.up_proj)
        return project(hidden, self.down_proj)


class SparseMoeBlock(nnx.Module):
    """A sparse layer's MLP: the router ``gate`` (HF's ``mlp.gate``, a bias-free
    ``[H -> X]`` linear) and the :class:`Experts` it picks from."""

    def __init__(self, spec: ModelSpec, *, dtype, param_dtype, rngs: nnx.Rngs):
        moe = spec.moe
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        h = spec.hidden_size
        self.gate = Dense((h,), (moe.num_experts,), ("embed",), ("expert",), use_bias=False,
                          **common)  # fmt: skip
        self.experts = Experts(h, moe.intermediate_size, moe.num_experts, **common)
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.dtype = dtype

    def __call__(self, x: jax.Array, real: jax.Array) -> tuple[jax.Array, Routing]:
        """``x [B, L, H]`` through the experts its router picks; ``real [B, L]`` marks the
        tokens the returned :class:`Routing` counts (every token is routed)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1]).astype(self.dtype)  # [N, H]
        probabilities = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)  # [N, X]
        top, chosen = jax.lax.top_k(probabilities, self.top_k)  # [N, K] each
        if self.norm_topk_prob:
            top = top / top.sum(axis=-1, keepdims=True)
        pairs = chosen.reshape(-1)  # [N * K]: pair n * K + k is token n's k-th expert
        order = jnp.argsort(pairs, stable=True)
        group_sizes = jnp.bincount(pairs, length=self.num_experts).astype(jnp.int32)
        outputs = self.experts(x[order // self.top_k], group_sizes)  # [N * K, H], sorted
        outputs = outputs[jnp.argsort(order)].reshape(*chosen.shape, -1)  # [N, K, H]
        y = jnp.einsum("nkh,nk->nh", outputs, top.astype(self.dtype))
        on = real.reshape(-1, 1).astype(jnp.float32)
        routing = Routing(
            assigned=(jax.nn.one_hot(chosen, self.num_experts) * on[..., None]).sum((0, 1)),
            probability=(probabilities * on).sum(axis=0),
            tokens=on.sum(),
        )
        return y.reshape(shape), routing
