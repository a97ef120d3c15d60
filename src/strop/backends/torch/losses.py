"""PPO losses in torch: differentiable, float32.

This backend's array primitives (:data:`OPS`: ``select``, ``token_logprobs``,
``token_entropy``, ``segment_mean``, ...), over which :mod:`strop.objectives`' losses are
written once for both backends: ``actor_critic.py`` calls the micro-batch losses
(:mod:`strop.objectives.micro`) with ``OPS`` and its forwards' logits and values. They
follow the conventions of :mod:`strop.objectives.losses` (see ``docs/ppo.md``
for the formulas) and are tested against the numpy float64 references in
``tests/losses_reference.py`` (``tests/parity/test_ppo_losses.py``,
``test_policy_losses.py``). Inputs are tensors (numpy arrays are accepted and put on the
CPU) and are cast to float32; results live on the inputs' device.
"""

from __future__ import annotations

from numbers import Number

import torch
import torch.nn.functional as F

from strop.objectives.losses import ArrayOps

F32 = torch.float32


def _tensors(*values):
    """``values`` with each number (Python or NumPy) a 0-d tensor on the tensors' device: a
    float one float32, so that, as in type promotion with a Python number, it keeps the
    tensors' dtype (jax.numpy's weak types do the same); ``None`` stays ``None``."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    return [
        torch.as_tensor(v, device=device, dtype=F32 if isinstance(v, float) else None)
        if isinstance(v, Number)
        else v
        for v in values
    ]


class TorchArrays:
    """``ops.xp`` on torch: the array module a loss is written with, with the ops
    ``docs/ppo.md`` lists (``exp``, ``clip``, ``where``, ``maximum``, ``minimum``, ``abs``,
    ``zeros_like``) taking Python numbers wherever an array goes and broadcasting as
    ``jax.numpy``'s do (``torch.minimum(ratio, 1.2)`` and ``torch.exp(0.5)`` raise, and
    ``torch.clip`` takes no tensor bound beside a number), so a loss runs the same on both
    backends (``tests/parity/test_array_ops.py``). Any other name is torch's own."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def exp(x) -> torch.Tensor:
        return torch.exp(*_tensors(x))

    @staticmethod
    def abs(x) -> torch.Tensor:
        return torch.abs(*_tensors(x))

    @staticmethod
    def zeros_like(x) -> torch.Tensor:
        return torch.zeros_like(*_tensors(x))

    @staticmethod
    def maximum(a, b) -> torch.Tensor:
        return torch.maximum(*_tensors(a, b))

    @staticmethod
    def minimum(a, b) -> torch.Tensor:
        return torch.minimum(*_tensors(a, b))

    @staticmethod
    def where(condition, a, b) -> torch.Tensor:
        return torch.where(*_tensors(condition, a, b))

    @staticmethod
    def clip(x, min=None, max=None) -> torch.Tensor:
        if isinstance(min, torch.Tensor) or isinstance(max, torch.Tensor):
            return torch.clip(*_tensors(x, min, max))  # tensor bounds: both tensors
        return torch.clip(*_tensors(x), min, max)


def _f32(x) -> torch.Tensor:
    return torch.as_tensor(x).to(F32)


def _on(mask) -> torch.Tensor:
    return torch.as_tensor(mask) > 0


def _select(on: torch.Tensor, x) -> torch.Tensor:
    """``x`` (as float32) where ``on``, else 0: masked columns never reach a non-linear op,
    so NaN/Inf there reach neither the result nor its gradient."""
    x = _f32(x)
    return torch.where(on.to(x.device), x, torch.zeros_like(x))


def entropy_from_logits(logits) -> torch.Tensor:
    """Entropy ``[B, L]`` of ``softmax(logits [B, L, V])`` per column, in float32
    (column ``j`` is the distribution of ``x_{j+1}``: shift right to align)."""
    logp = torch.log_softmax(_f32(logits), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def _shift(per_column: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]`` values about ``x_1..x_{L-1}`` -> ``[B, L]`` with column 0 = 0."""
    return F.pad(per_column, (1, 0))


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``[B, L]``: ``log softmax(logits / T)`` of ``x_t`` from the logits at ``t - 1``."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    chosen = torch.gather(logp, -1, input_ids[:, 1:, None].long())[..., 0]
    return _shift(chosen)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, L]``: the entropy of ``softmax(logits / T)`` at ``t - 1``, column ``t``."""
    return _shift(entropy_from_logits(logits[:, :-1].float() / temperature))


def segment_mean(x: torch.Tensor, segments: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """On each ``on`` token, the mean of ``x`` over the ``on`` tokens of its row with its
    segment id (:attr:`~strop.objectives.losses.ArrayOps.segment_mean`); 0 elsewhere."""
    rows, columns = x.shape
    row = torch.arange(rows, device=x.device)[:, None] * (columns + 1)
    keys = (row + segments.to(x.device).long().clamp(0, columns)).reshape(-1)
    x, on = _select(on, x), on.to(x.device)
    sums = x.new_zeros(rows * (columns + 1)).index_add(0, keys, x.reshape(-1))
    tokens = x.new_zeros(rows * (columns + 1)).index_add(0, keys, on.to(F32).reshape(-1))
    means = (sums / tokens.clamp(min=1.0))[keys].reshape(rows, columns)
    return torch.where(on, means, torch.zeros_like(means))


OPS = ArrayOps(
    xp=TorchArrays(), on=_on, select=_select, indicator=lambda b: b.to(F32),
    stop_gradient=torch.Tensor.detach, token_logprobs=token_logprobs,
    token_entropy=token_entropy, segment_mean=segment_mean,
)  # fmt: skip
