"""The JAX backend: Flax NNX models sharded over a ``jax.sharding.Mesh``."""

from strop.backends.jax.handle import JaxModelHandle, load_model
from strop.backends.jax.policy import JaxPolicy

build_policy = JaxPolicy

__all__ = ["JaxModelHandle", "JaxPolicy", "build_policy", "load_model"]
