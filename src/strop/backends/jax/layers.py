"""The building blocks of :mod:`strop.backends.jax.model`'s decoder: :class:`Dense` (the
projection Qwix intercepts for LoRA), :class:`Embedding` and :class:`RMSNorm`, each
weight carrying its logical axes for :mod:`strop.backends.jax.sharding`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def _param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], dtype, init):
    """A parameter with logical axes; placement on devices happens when weights load."""
    return nnx.Param(
        init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(axes), eager_sharding=False
    )


class Dense(nnx.Module):
    """``y = x @ kernel + bias`` with ``x [..., *in_shape]`` and ``y [..., *out_shape]``.

    The kernel is flat, ``[prod(in_shape), prod(out_shape)]``: HF's
    ``nn.Linear(prod(in_shape), prod(out_shape)).weight`` transposed, and the bias is
    ``[prod(out_shape)]``. ``x`` is flattened to ``[rows, prod(in_shape)]`` before the
    einsum and the output unflattened after it, so callers see the multi-dimensional
    shapes (``[B, L, H, D]`` from q) while the einsum (the one Qwix intercepts, adding
    ``kernel_lora_a [in, r]`` and ``kernel_lora_b [r, out]``) is a plain 2-D matrix
    product, the form XLA:CPU's fast matmul path takes forward and backward.

    A flat dim carries one logical axis, the leading name of its group (``heads`` for
    ``heads x head_dim``); :meth:`kernel_blocks` says how many elements one unit of that name
    spans (``head_dim``), so sharding splits it only into whole heads.
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        in_axes: tuple[str, ...],
        out_axes: tuple[str, ...],
        *,
        use_bias: bool,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        self.in_shape, self.out_shape = in_shape, out_shape
        self.dtype = dtype
        n_in, n_out = math.prod(in_shape), math.prod(out_shape)
        init = nnx.initializers.normal(0.02)
        self.kernel = _param(rngs, (n_in, n_out), (in_axes[0], out_axes[0]), param_dtype, init)
        self.bias = (
            _param(rngs, (n_out,), (out_axes[0],), param_dtype, nnx.initializers.zeros)
            if use_bias
            else None
        )

    def kernel_blocks(self) -> tuple[int, int]:
        """Elements per unit of each kernel dim's logical axis (``head_dim`` for ``heads``)."""
        return math.prod(self.in_shape[1:]), math.prod(self.out_shape[1:])

    def __call__(self, x: jax.Array) -> jax.Array:
        # Rows as one dim too: with "...a,ab" the kernel's gradient came out of XLA:CPU as
        # a transposed dot off its fast path (1.6x the multi-dimensional kernel's time).
        lead = x.shape[: x.ndim - len(self.in_shape)]
        x = x.reshape(math.prod(lead), math.prod(self.in_shape)).astype(self.dtype)
        kernel = self.kernel
        if isinstance(kernel, nnx.Variable):  # else Qwix's quantized kernel (a frozen
            kernel = kernel[...].astype(self.dtype)  # QLoRA base), which its einsum takes
        with self._adapters_in_compute_dtype():
            y = jnp.einsum("na,ab->nb", x, kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y.reshape(*lead, *self.out_shape)

    @contextlib.contextmanager
    def _adapters_in_compute_dtype(self) -> Iterator[None]:
        """Qwix's LoRA einsum (run inside this block) reads ``kernel_lora_a``/``_b`` as
        stored, and float32 adapters (:func:`strop.backends.jax.lora.apply_lora` keeps them
        so over a lower-precision base) would turn this projection's output, and all that
        follows it, to float32. For the call they are replaced by their casts to ``dtype``,
        as torch's autocast casts its weights, and put back after it; gradients reach the
        float32 values through the cast. The attributes are swapped, not the variables'
        values: a sampler's loop body may run a module merged there from variables of an
        outer trace, which NNX lets it set attributes on but not mutate."""
        names = [
            name
            for name in ("kernel_lora_a", "kernel_lora_b")
            if getattr(self, name, None) is not None
            and getattr(self, name).get_value().dtype != self.dtype
        ]
        stored = {name: getattr(self, name) for name in names}
        for name, variable in stored.items():
            setattr(self, name, type(variable)(variable.get_value().astype(self.dtype)))
        try:
            yield
        finally:
            for name, variable in stored.items():
                setattr(self, name, variable)


class Embedding(nnx.Module):
    """Token embedding table ``[V, E]``; also the output projection when tied."""

    def __init__(self, vocab: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        init = nnx.initializers.normal(0.02)
        self.embedding = _param(rngs, (vocab, hidden), ("vocab", "embed"), param_dtype, init)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits ``x @ embedding.T`` for a tied LM head."""
        return jnp.einsum("...e,ve->...v", x, self.embedding[...].astype(self.dtype))


class RMSNorm(nnx.Module):
    """RMSNorm as in HF over the last dim (``size`` wide). Normalise in float32, then either
    cast back and scale by ``weight`` in the compute dtype (Llama, Qwen), or
    (``scale_in_float32``: OLMo 2, Gemma) scale by ``offset + weight`` in float32 and cast
    back; Gemma's ``offset`` is 1 (its weights start at 0). ``axis`` is the weight's logical
    axis (``norm`` over the hidden size, ``head_dim`` for a per-head q/k norm). Initialised
    to the identity either way."""

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        axis: str = "norm",
        offset: float = 0.0,
        scale_in_float32: bool = False,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        self.eps, self.offset, self.dtype = eps, offset, dtype
        self.scale_in_float32 = scale_in_float32 or bool(offset)
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.weight = _param(rngs, (size,), (axis,), param_dtype, init)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.scale_in_float32:
            scale = self.offset + self.weight[...].astype(jnp.float32)
            return (normed * scale).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)
