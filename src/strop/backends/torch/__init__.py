"""The torch backend: ``transformers`` models, PEFT LoRA, FSDP2/DTensor sharding, DCP."""

from strop.backends.torch.handle import TorchModelHandle, load_model
from strop.backends.torch.policy import TorchPolicy

build_policy = TorchPolicy

__all__ = ["TorchModelHandle", "TorchPolicy", "build_policy", "load_model"]
