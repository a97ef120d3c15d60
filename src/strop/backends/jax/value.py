"""The critic on the JAX backend: a scalar value head on the final normed hidden state.

``ValueModel.raw_values`` is the head applied at every column (``raw[:, j]`` has read
``x_<=j``, so it estimates ``V(s_{j+1})``); ``ValueModel.values`` shifts it into the
token convention of :mod:`strop.objectives.gae` (``values[:, t] = V(x_<t) = raw[:, t - 1]``,
``values[:, 0] = 0``) with :func:`strop.objectives.gae.shift_values`. See
``docs/ppo.md``.

The head is always float32 (kernel ``[E, 1]``, bias ``[1]``) whatever the model's dtype,
and the hidden state is cast to float32 before it: a bfloat16 value would carry only
about 3 significant digits into GAE. Its initial values come from
:func:`strop.lora_init.value_head` for ``seed`` (kernel ``normal(0, 1/sqrt(E))``, so a
unit-RMS hidden state, which RMSNorm roughly gives, yields values of order 1 at the
start; bias 0): the same numbers as the torch backend's head.

Sharding: the kernel carries the logical axes ``("embed", None)``, like the LM head's
input axis, and is placed over the mesh by those rules when a ``mesh`` is given (on a
mesh with ``fsdp`` > 1 its ``E`` rows are split over ``fsdp``; a size ``fsdp`` does not
divide stays replicated). The bias (``(None,)``) is replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from strop.backends.jax.model import CausalLM
from strop.backends.jax.sharding import logical_to_sharding, to_host
from strop.lora_init import value_head as initial_value_head
from strop.objectives.gae import shift_values

KERNEL_AXES = ("embed", None)
BIAS_AXES = (None,)


def _place(value: jax.Array, axes, mesh: Mesh | None) -> jax.Array:
    if mesh is None:
        return value
    return jax.device_put(value, logical_to_sharding(axes, value.shape, mesh))


class ValueHead(nnx.Module):
    """``v = hidden.astype(float32) @ kernel + bias`` -> ``[..., 1]`` float32."""

    def __init__(self, hidden: int, *, seed: int = 0, mesh: Mesh | None = None):
        self.hidden = hidden
        kernel_values, bias_value = initial_value_head(seed, hidden)
        kernel = jnp.asarray(kernel_values[:, None])
        self.kernel = nnx.Param(
            _place(kernel, KERNEL_AXES, mesh), out_sharding=KERNEL_AXES, eager_sharding=False
        )
        bias = jnp.full((1,), bias_value, jnp.float32)
        self.bias = nnx.Param(
            _place(bias, BIAS_AXES, mesh), out_sharding=BIAS_AXES, eager_sharding=False
        )

    def __call__(self, hidden: jax.Array) -> jax.Array:
        x = hidden.astype(jnp.float32)
        return jnp.einsum("...e,eo->...o", x, self.kernel[...]) + self.bias[...]

    def set_weights(self, kernel: np.ndarray, bias: float) -> None:
        """Set ``kernel [E]`` and scalar ``bias`` (kept float32 and placed where the
        current parameters are)."""
        kernel = np.asarray(kernel, dtype=np.float32)
        if kernel.shape != (self.hidden,):
            raise ValueError(
                f"value head kernel has shape {kernel.shape}, expected ({self.hidden},)"
            )
        old_kernel, old_bias = self.kernel.get_value(), self.bias.get_value()
        self.kernel.set_value(jax.device_put(kernel[:, None], old_kernel.sharding))
        bias_value = np.asarray([bias], dtype=np.float32)
        self.bias.set_value(jax.device_put(bias_value, old_bias.sharding))

    def weights(self) -> tuple[np.ndarray, float]:
        """``(kernel [E] float32, bias)`` on the host."""
        kernel = to_host(self.kernel.get_value())[:, 0]
        return kernel.astype(np.float32), float(to_host(self.bias.get_value())[0])


class ValueModel(nnx.Module):
    """A :class:`CausalLM` backbone (``self.lm``) plus a :class:`ValueHead`."""

    def __init__(self, lm: CausalLM, *, seed: int = 0, mesh: Mesh | None = None):
        self.lm = lm
        self.value_head = ValueHead(lm.spec.hidden_size, seed=seed, mesh=mesh)

    def raw_values(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """``[B, L]`` float32: the head at every column (``raw[:, j]`` ~ ``V(x_<=j)``)."""
        hidden = self.lm(input_ids, attention_mask, positions, logits_to_keep=1).hidden
        return self.value_head(hidden)[..., 0]

    def values(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """``[B, L]`` float32 in the GAE convention: ``values[:, t] = V(x_<t)``."""
        return shift_values(self.raw_values(input_ids, attention_mask, positions), xp=jnp)

    def set_head(self, kernel: np.ndarray, bias: float) -> None:
        """Set the head to ``kernel [E]`` and scalar ``bias`` (:meth:`ValueHead.set_weights`)."""
        self.value_head.set_weights(kernel, bias)

    def head_weights(self) -> tuple[np.ndarray, float]:
        """``(kernel [E] float32, bias)`` on the host."""
        return self.value_head.weights()


def critic_trainable_filter(lora_enabled: bool) -> nnx.filterlib.Filter:
    """What trains in the critic: its LoRA params (or all params) *and* the value head."""
    if not lora_enabled:
        return nnx.Param
    return nnx.Any(nnx.LoRAParam, nnx.All(nnx.Param, nnx.PathContains("value_head")))


def twin(module: nnx.Module) -> nnx.Module:
    """A second module tree over the same arrays (no copy of any weight): the critic's
    base, when LoRA puts a critic adapter on the actor's."""
    return nnx.merge(*nnx.split(module))
