"""The JAX backend: Flax NNX models sharded over a ``jax.sharding.Mesh``."""

from strop.backends.jax.actor_critic import JaxActorCritic
from strop.backends.jax.compile_cache import enable_compilation_cache
from strop.backends.jax.handle import JaxModelHandle, load_model
from strop.backends.jax.model import check_model
from strop.backends.jax.policy import JaxPolicy
from strop.backends.jax.reward_model import JaxRewardModel, build_reward_model
from strop.backends.jax.sharding import device_count, shut_down, write_once

enable_compilation_cache()  # importing compiles nothing; every compile after this is cached

build_policy = JaxPolicy
build_actor_critic = JaxActorCritic

__all__ = [
    "JaxActorCritic",
    "JaxModelHandle",
    "JaxPolicy",
    "JaxRewardModel",
    "build_actor_critic",
    "build_policy",
    "build_reward_model",
    "check_model",
    "device_count",
    "load_model",
    "shut_down",
    "write_once",
]
