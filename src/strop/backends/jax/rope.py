"""Rotary position embeddings for :mod:`strop.backends.jax.model`: the inverse frequencies
and attention factors ``transformers`` computes (``ROPE_INIT_FUNCTIONS``), the ones that
depend on the sequence length chosen as its ``dynamic_rope_update`` chooses them, and the
rotation (HF's rotate-half, over the first ``rotary_dim`` dims of each head).

Host tables (:func:`rope_inv_freq`) are the float32 values torch computes, operation by
operation: torch rounds each Python scalar to float32 before using it, evaluates
``c / tensor`` as ``tensor.reciprocal() * c`` (two roundings), and its float32 ``pow`` is
taken correctly rounded here (computed in float64, then rounded). numpy's own float32
``power`` is not: it was up to 2 ulp off, and the llama3 smoothing made that up to 11 ulp,
which moves logits over long sequences (angles of hundreds of radians).

Sequence length at run time (:func:`inv_freq_at`), as transformers' ``dynamic_rope_update``
does for every forward, with ``seq_len = max(position_ids) + 1`` over the whole batch (so a
row's rotation depends on the longest row it is batched with, as in transformers):

- ``longrope``: the ``long_factor`` table when ``seq_len > original_max_position_embeddings``,
  else the ``short_factor`` one. In a KV-cache decode ``seq_len`` is the new token's position
  + 1, so the queries and keys of the step that crosses the threshold switch to the long
  table while the cached keys keep the short one. transformers' Phi-3 ``generate``
  recomputes the whole cache at that step instead, and so does the JAX sampler
  (:func:`cache_reset_position`, ``generate._decode``).
- ``dynamic`` (NTK): ``rope_theta`` scaled for ``seq_len`` when it exceeds
  ``max_position_embeddings`` (computed on device, in float32, to about 1e-7 of torch's),
  else the plain table. transformers' module also keeps the largest scaled table it has
  computed (``max_seq_len_cached``) for later calls longer than ``max_position_embeddings``;
  here each call uses its own length: the same as transformers on a fresh model and in
  ``generate`` (whose lengths only grow).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from strop.models import ModelSpec, Rope

_F32 = np.float32


def _pow32(base: float, exponents: np.ndarray) -> np.ndarray:
    """``float32(base) ** exponents`` (float32), correctly rounded."""
    base = float(_F32(base))
    return np.array([math.pow(base, float(e)) for e in exponents], np.float64).astype(_F32)


def _exponents(dim: int) -> np.ndarray:
    """``arange(0, dim, 2) / dim`` in float32 (torch: int64 arange, ``.float()``, ``/ dim``)."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(_F32) / _F32(dim)


def _default(rope: Rope, seq_len: int | None) -> np.ndarray:
    return _F32(1.0) / _pow32(rope.theta, _exponents(rope.rotary_dim))


def _linear(rope: Rope, seq_len: int | None) -> np.ndarray:
    return _default(rope, seq_len) / _F32(rope.get("factor"))


def _llama3(rope: Rope, seq_len: int | None) -> np.ndarray:
    """Keep high frequencies, divide low ones by ``factor``, interpolate in between."""
    inv_freq, factor = _default(rope, seq_len), _F32(rope.get("factor"))
    old_len = rope.get("original_max_position_embeddings")
    low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
    low_wavelen, high_wavelen = _F32(old_len / low), _F32(old_len / high)
    wavelen = (_F32(1.0) / inv_freq) * _F32(2 * math.pi)  # torch: 2 * pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = ((_F32(1.0) / wavelen) * _F32(old_len) - _F32(low)) / _F32(high - low)
    smoothed = (_F32(1.0) - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(_F32)


def _original_max(rope: Rope) -> int:
    """The pretraining length yarn and longrope scale from (transformers' default: the
    model's ``max_position_embeddings``)."""
    return rope.get("original_max_position_embeddings", rope.max_position_embeddings)


def _yarn(rope: Rope, seq_len: int | None) -> np.ndarray:
    """Interpolate (divide by ``factor``) the dims that rotate fewer than ``beta_slow``
    times over the pretraining length, extrapolate (keep) those above ``beta_fast``, and
    ramp linearly in between (transformers' ``_compute_yarn_parameters``)."""
    dim, base, factor = rope.rotary_dim, rope.theta, rope.get("factor")
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    old_len = _original_max(rope)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp
    pos_freqs = _pow32(base, _exponents(dim))
    extrapolated = _F32(1.0) / pos_freqs
    interpolated = _F32(1.0) / (_F32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1)
    kept = _F32(1.0) - ramp
    return interpolated * (_F32(1.0) - kept) + extrapolated * kept


def _longrope(rope: Rope, seq_len: int | None) -> np.ndarray:
    """Frequencies divided by ``long_factor`` past the pretraining length, else by
    ``short_factor``."""
    long = seq_len is not None and seq_len > _original_max(rope)
    factors = np.asarray(rope.get("long_factor" if long else "short_factor"), _F32)
    return _F32(1.0) / (factors * _pow32(rope.theta, _exponents(rope.rotary_dim)))


_INV_FREQ: dict[str, Callable[[Rope, int | None], np.ndarray]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    "dynamic": _default,  # below max_position_embeddings; longer: dynamic_inv_freq
}
KINDS = tuple(_INV_FREQ)
"""The RoPE types this decoder computes (of :data:`strop.models.rope.ROPE_KINDS`)."""


def rope_inv_freq(rope: Rope, seq_len: int | None = None) -> np.ndarray:
    """RoPE inverse frequencies ``[rotary_dim / 2]`` (float32): what
    ``ROPE_INIT_FUNCTIONS[rope.kind](config, seq_len=seq_len)`` returns, for a forward whose
    longest sequence is ``seq_len`` (``None``: the table a model holds after ``__init__``).
    ``dynamic`` past ``max_position_embeddings`` is :func:`dynamic_inv_freq`'s (on device)."""
    if rope.kind not in _INV_FREQ:
        raise NotImplementedError(f"rope type {rope.kind!r}")  # refused at check_model
    return _INV_FREQ[rope.kind](rope, seq_len).astype(_F32)


def attention_factor(rope: Rope) -> float:
    """The factor transformers multiplies cos and sin by (its ``attention_scaling``): yarn's
    ``0.1 ln(factor) + 1`` (or the ``mscale`` ratio, DeepSeek's), longrope's
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``, or the config's own
    ``attention_factor``; 1 for the other kinds."""
    given = rope.get("attention_factor")
    if rope.kind not in ("yarn", "longrope"):
        return 1.0
    if given is not None:
        return float(given)
    factor = rope.get("factor")
    if rope.kind == "longrope":
        if factor is None:  # Phi-3: the context extension ratio
            factor = rope.max_position_embeddings / _original_max(rope)
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(_original_max(rope)))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


@functools.cache
def _table(rope: Rope, seq_len: int | None = None) -> np.ndarray:
    """:func:`rope_inv_freq`, computed once per (rope, length) per process."""
    return rope_inv_freq(rope, seq_len)


def dynamic_inv_freq(rope: Rope, seq_len: jax.Array) -> jax.Array:
    """Dynamic NTK's inverse frequencies for ``seq_len`` (a traced int), in float32 as
    transformers' ``_compute_dynamic_ntk_parameters`` computes them from a tensor length:
    ``base = theta * (factor * s / max_pos - (factor - 1)) ** (dim / (dim - 2))`` with
    ``s = max(seq_len, max_pos)``. XLA's float32 ``pow`` is not torch's: within a few ulp."""
    f32, dim, max_pos = jnp.float32, rope.rotary_dim, rope.max_position_embeddings
    factor = rope.get("factor")
    length = jnp.maximum(seq_len, max_pos).astype(f32)
    ratio = (f32(factor) * length) / f32(max_pos) - f32(factor - 1)
    base = f32(rope.theta) * jnp.power(ratio, f32(dim / (dim - 2)))
    return jnp.reciprocal(jnp.power(base, jnp.asarray(_exponents(dim))))


def inv_freq_at(rope: Rope, seq_len: jax.Array) -> jax.Array:
    """The inverse frequencies ``[rotary_dim / 2]`` of a forward whose longest sequence is
    ``seq_len`` (a traced int), switching tables as transformers' ``dynamic_rope_update``."""
    table = jnp.asarray(_table(rope))
    if rope.kind == "longrope":
        long = jnp.asarray(_table(rope, _original_max(rope) + 1))
        return jnp.where(seq_len > _original_max(rope), long, table)
    if rope.kind == "dynamic":
        scaled = dynamic_inv_freq(rope, seq_len)
        return jnp.where(seq_len > rope.max_position_embeddings, scaled, table)
    return table


def cache_reset_position(spec: ModelSpec) -> int | None:
    """The position whose decode step transformers' ``generate`` recomputes the whole KV
    cache at (``Phi3ForCausalLM.prepare_inputs_for_generation``): longrope's
    ``original_max_position_embeddings``, the first position rotated by the long factors,
    when the keys cached before it were rotated by the short ones. ``None``: no layer's
    tables switch so (dynamic's change at every step past ``max_position_embeddings``, and
    transformers keeps its cache there)."""
    switches = [
        _original_max(layer.rope)
        for layer in spec.layers
        if layer.rope is not None and layer.rope.kind == "longrope"
    ]
    return min(switches, default=None)


def rope_cos_sin(rope: Rope, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` ``[B, L, rotary_dim]`` (float32, times :func:`attention_factor`)
    of ``positions [B, L]``; the length the tables are chosen for is the batch's largest
    position + 1, as in transformers."""
    inv_freq = inv_freq_at(rope, jnp.max(positions) + 1)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, R/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    scale = _F32(attention_factor(rope))
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``R`` dims of each head of ``x [B, L, N, D]`` by ``cos``/``sin``
    ``[B, L, R]`` (HF's rotate-half convention, cos and sin cast to ``x``'s dtype first);
    dims ``R..D-1`` pass through unrotated (partial rotary, Phi-3's ``apply_rotary_pos_emb``)."""
    rotary = cos.shape[-1]
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    rot, passed = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, passed], axis=-1)
