"""The torch backend: ``transformers`` models, PEFT LoRA, FSDP2/DTensor sharding, DCP."""

from strop.backends.torch.actor_critic import TorchActorCritic
from strop.backends.torch.fsdp import device_count, shut_down, write_once
from strop.backends.torch.handle import TorchModelHandle, load_model
from strop.backends.torch.policy import TorchPolicy
from strop.backends.torch.reward_model import TorchRewardModel, build_reward_model

build_policy = TorchPolicy
build_actor_critic = TorchActorCritic

__all__ = [
    "TorchActorCritic",
    "TorchModelHandle",
    "TorchPolicy",
    "TorchRewardModel",
    "build_actor_critic",
    "build_policy",
    "build_reward_model",
    "device_count",
    "load_model",
    "shut_down",
    "write_once",
]
