"""The JAX backend: Flax NNX models sharded over a ``jax.sharding.Mesh``."""

from strop.backends.jax.handle import JaxModelHandle, load_model

__all__ = ["JaxModelHandle", "load_model"]
