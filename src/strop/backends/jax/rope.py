"""Rotary position embeddings for :mod:`strop.backends.jax.model`: the inverse
frequencies ``transformers`` computes, to the bit, and the rotation (HF's rotate-half)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from strop.models import Rope

KINDS = ("default", "linear", "llama3")
"""The RoPE types this decoder computes (of :data:`strop.models.rope.ROPE_KINDS`)."""


def rope_inv_freq(rope: Rope) -> np.ndarray:
    """RoPE inverse frequencies ``[rotary_dim / 2]`` (float32), with linear or llama3
    scaling.

    The float32 values ``transformers`` computes (``compute_default_rope_parameters``,
    ``_compute_llama3_parameters``, ``_compute_linear_scaling_rope_parameters``), operation
    by operation: torch rounds each Python scalar to float32 before using it, evaluates
    ``c / tensor`` as ``tensor.reciprocal() * c`` (two roundings), and its float32 ``pow``
    is taken correctly rounded here (computed in float64, then rounded). numpy's own float32
    ``power`` is not: it was up to 2 ulp off, and the llama3 smoothing made that up to 11 ulp,
    which moves logits over long sequences (angles of hundreds of radians).
    """
    f32 = np.float32
    dim = rope.rotary_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
    base = float(f32(rope.theta))
    powers = np.array([math.pow(base, float(e)) for e in exponents], np.float64).astype(f32)
    inv_freq = f32(1.0) / powers
    if rope.kind == "default":
        return inv_freq
    if rope.kind not in KINDS:
        raise NotImplementedError(f"rope type {rope.kind!r}")  # refused at check_model
    factor = f32(rope.get("factor"))
    if rope.kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = rope.get("original_max_position_embeddings")
    low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
    low_wavelen, high_wavelen = f32(old_len / low), f32(old_len / high)
    wavelen = (f32(1.0) / inv_freq) * f32(2 * math.pi)  # torch: 2 * pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = ((f32(1.0) / wavelen) * f32(old_len) - f32(low)) / f32(high - low)
    smoothed = (f32(1.0) - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(f32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x [B, L, N, D]`` by ``positions [B, L]`` (HF's rotate-half convention)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, L, D/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
