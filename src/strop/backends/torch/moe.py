"""Routed experts in training: the router's load-balancing loss (Switch Transformer's).

transformers computes it when asked for the router logits, but over its ``attention_mask``
read as ``[B, L]`` 0/1, which strop's packed rows replace with 4-D masks
(:mod:`strop.backends.torch.masks`); so strop asks for the logits and computes the loss
over the real tokens itself, as transformers' ``load_balancing_loss_func`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from strop.batch.packing import PREFIX_STRIDE
from strop.models import ModelSpec, MoeSpec


def router_outputs(spec: ModelSpec) -> dict[str, Any]:
    """The forward's keyword arguments that return the router logits of a MoE ``spec``."""
    return {"output_router_logits": True} if spec.moe is not None else {}


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], real: torch.Tensor, moe: MoeSpec
) -> torch.Tensor:
    """``num_experts * sum_e f_e P_e`` over the routed layers' real tokens: ``f_e`` the
    fraction of top-k assignments that go to expert ``e``, ``P_e`` its mean router
    probability. 1 when routing is uniform; it grows as the router favours a few experts.

    Args:
      router_logits: each routed layer's ``[B * L, num_experts]`` logits.
      real: ``[B, L]``, true on real tokens (padding is left out).
    """
    weights = real.reshape(-1).float()
    assigned = torch.zeros(moe.num_experts, device=weights.device)
    probability = torch.zeros(moe.num_experts, device=weights.device)
    for logits in router_logits:
        probs = logits.float().softmax(-1)
        chosen = probs.topk(moe.top_k, dim=-1).indices.reshape(-1)
        assigned = assigned.scatter_add(0, chosen, weights.repeat_interleave(moe.top_k))
        probability = probability + (probs * weights[:, None]).sum(0)
    tokens = weights.sum() * len(router_logits)
    return moe.num_experts * ((assigned / tokens) * (probability / tokens)).sum()


def aux_loss(spec: ModelSpec, outputs: Any, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """The load-balancing loss of a forward's ``outputs`` (run with :func:`router_outputs`)
    over the real tokens of its ``attention_mask`` (0/1, or packed segment ids), ``None``
    for a model without routed experts."""
    if spec.moe is None or not outputs.router_logits:
        return None
    real = attention_mask % PREFIX_STRIDE > 0
    return load_balancing_loss(outputs.router_logits, real, spec.moe)
