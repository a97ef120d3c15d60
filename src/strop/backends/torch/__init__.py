"""The torch backend: ``transformers`` models, PEFT LoRA, FSDP2/DTensor sharding, DCP."""

# ruff: noqa: E402  (a logger is set before the imports below load PEFT)
import logging

# bitsandbytes (installed for QLoRA; PEFT imports it whenever it is installed) warns at
# import, on CPUs with AVX512-BF16, that the optional `kernels` package is missing (it
# fetches a faster CPU kernel from the Hugging Face hub) and uses its own: one line on
# every torch run's stderr, about a speed-up an offline run cannot have. Silenced here,
# before anything imports PEFT.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from strop.backends.torch.actor_critic import TorchActorCritic
from strop.backends.torch.fsdp import device_count, shut_down, write_once
from strop.backends.torch.handle import TorchModelHandle, load_model
from strop.backends.torch.model import check_model
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
    "check_model",
    "device_count",
    "load_model",
    "shut_down",
    "write_once",
]
