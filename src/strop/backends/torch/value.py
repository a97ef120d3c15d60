"""The critic on the torch backend: a scalar value head on the final normed hidden state.

Same contract as :mod:`strop.backends.jax.value`: ``raw_values`` is the head at every
column (``raw[:, j]`` ~ ``V(x_<=j)``), ``values`` is ``shift_values(raw)`` in the token
convention of :mod:`strop.objectives.gae` (``values[:, t] = V(x_<t)``); see ``docs/ppo.md``.

The head is an ``nn.Linear(E, 1)`` kept in float32 whatever the model's dtype, run outside
autocast on the hidden state cast to float32. Its initial weight and bias come from
:func:`strop.lora_init.value_head` for ``seed`` (``normal(0, 1/sqrt(E))``, 0): the same
numbers as the JAX backend's head, on every rank.

How the hidden state is read: the whole model (``LoadedModel.model``, plain HF or
PEFT-wrapped, FSDP2-sharded or not) is called with ``output_hidden_states=True`` and
``logits_to_keep=1`` (so the LM head only runs on the last column), and
``hidden_states[-1]`` is taken. For Qwen2 and Llama that entry is the decoder's output
after the final RMSNorm (equal to ``model.model(...).last_hidden_state``; the test holds
it to that). Calling the inner decoder directly would be cheaper by one column of
logits but would bypass the root module's forward hooks: FSDP2's root ``fully_shard``
(which unshards the embeddings and final norm) and PEFT's wrapper.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from strop.backends.torch.model import LoadedModel, final_hidden
from strop.lora_init import value_head as initial_value_head
from strop.objectives.gae import shift_values


class ValueHead(nn.Module):
    """``v = hidden.float() @ weight.T + bias`` -> ``[..., 1]`` float32."""

    def __init__(self, hidden: int, *, seed: int = 0, device: torch.device | str = "cpu"):
        super().__init__()
        self.hidden = hidden
        self.linear = nn.Linear(hidden, 1, dtype=torch.float32, device=device)
        kernel, bias = initial_value_head(seed, hidden)
        with torch.no_grad():
            self.linear.weight.copy_(torch.from_numpy(kernel)[None, :])
            self.linear.bias.fill_(bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # ``linear`` of a [B, L, E] input returns a view of its 2-D matmul; FSDP2 warns
        # that in-place ops on a view returned by a sharded module would skip its
        # pre-backward hook. ``clone`` ([B, L] floats) returns a tensor of its own.
        return self.linear(hidden.float()).clone()


class ValueModel(nn.Module):
    """A loaded causal LM backbone (``self.lm``) plus a :class:`ValueHead`."""

    def __init__(self, loaded: LoadedModel, *, seed: int = 0):
        super().__init__()
        self.loaded = loaded
        self.lm = loaded.model
        self.value_head = ValueHead(
            loaded.spec.hidden_size, seed=seed, device=loaded.placement.device
        )

    def hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final normed hidden state ``[B, L, E]`` (in the compute dtype)."""
        return final_hidden(self.loaded, input_ids, attention_mask, positions)

    def raw_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, L]`` float32: the head at every column (``raw[:, j]`` ~ ``V(x_<=j)``)."""
        hidden = self.hidden(input_ids, attention_mask, positions)
        with torch.autocast(hidden.device.type, enabled=False):
            return self.value_head(hidden)[..., 0]

    def values_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`values` from the final normed hidden state ``hidden [B, L, E]`` of a
        forward: :meth:`values` runs its own, ``critic.shared_trunk`` reads it off the
        actor's forward."""
        with torch.autocast(hidden.device.type, enabled=False):
            return shift_values(self.value_head(hidden)[..., 0], xp=torch)

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, L]`` float32 in the GAE convention: ``values[:, t] = V(x_<t)``."""
        return self.values_from_hidden(self.hidden(input_ids, attention_mask, positions))

    forward = values

    def set_head(self, kernel: np.ndarray, bias: float) -> None:
        """Set the head to ``kernel [E]`` and scalar ``bias`` (kept float32)."""
        kernel = np.asarray(kernel, dtype=np.float32)
        if kernel.shape != (self.value_head.hidden,):
            raise ValueError(
                f"value head kernel has shape {kernel.shape}, expected ({self.value_head.hidden},)"
            )
        linear = self.value_head.linear
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(kernel)[None, :])
            linear.bias.fill_(float(bias))

    def head_weights(self) -> tuple[np.ndarray, float]:
        """``(kernel [E] float32, bias)`` on the host."""
        linear = self.value_head.linear
        kernel = linear.weight.detach().cpu().float().numpy()[0].copy()
        return kernel, float(linear.bias.detach().cpu()[0])
