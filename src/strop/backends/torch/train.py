"""The torch train step: micro-batch accumulation, global token normalisation, clipping.

Same contract as the JAX backend's ``train.py``: the loss of a batch is the summed
next-token cross-entropy over its target tokens divided by the *global* target-token
count (all micro-batches, all ranks), so neither micro-batching nor the number of
processes changes the update. Each rank backpropagates ``its sum / global count``;
FSDP2 then *sums* the ranks' gradients (see ``fsdp.py``).

Token alignment: ``loss_mask[:, t] = 1`` means token ``x_t`` is a target, predicted from
the logits at position ``t - 1``.

Randomness inside a step (LoRA dropout) is reseeded from (seed, update, rank) at every
update, so a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from strop.backends.torch.fsdp import Placement, all_reduce_max, all_reduce_sum
from strop.backends.torch.model import LoadedModel
from strop.config import OptimConfig
from strop.errors import ConfigError
from strop.objectives.losses import MAX_STATS
from strop.schedules import learning_rate

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask")

MicroLoss = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(micro) -> (loss, stats)``: a micro-batch's weighted share of an update's loss."""


def make_optimizer(params: list[torch.nn.Parameter], config: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer a run's ``optim:`` section describes (lr is set every update)."""
    if config.name == "adamw":
        return torch.optim.AdamW(
            params,
            lr=config.lr,
            betas=(config.b1, config.b2),
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    if config.name == "sgd":  # plain SGD with L2 weight decay, as optax.sgd in the jax backend
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    raise ConfigError(f"optim.name: {config.name!r} is not supported by the torch backend")


def token_loss_sum(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over target tokens, and their count (float32)."""
    vocab = logits.shape[-1]
    losses = F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(),
        input_ids[:, 1:].reshape(-1),
        reduction="none",
    )
    mask = loss_mask[:, 1:].reshape(-1).float()
    return (losses * mask).sum(), mask.sum()


def sft_micro_loss(
    logits: torch.Tensor, micro: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's share of the SFT loss: next-token cross-entropy weighted by its
    ``loss_weights`` (:mod:`strop.objectives.sft`); no stats besides the loss."""
    vocab = logits.shape[-1]
    losses = F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(),
        micro["input_ids"][:, 1:].reshape(-1),
        reduction="none",
    )
    return (losses * micro["loss_weights"][:, 1:].reshape(-1).float()).sum(), {}


def grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients, whole on every rank (sharded grads included)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def rank_rows(
    batch: Mapping[str, np.ndarray], names: Sequence[str], micro_batches: int, placement: Placement
) -> dict[str, torch.Tensor]:
    """This rank's contiguous share of the global ``[B, ...]`` batch as device tensors
    ``[micro, rows, ...]`` (integer arrays as int64, floating ones as float32)."""
    rows = np.asarray(batch[names[0]]).shape[0]
    if rows % (placement.world_size * micro_batches):
        raise ConfigError(
            f"batch of {rows} rows does not split into {placement.world_size} process(es) "
            f"x {micro_batches} micro-batches"
        )
    out = {}
    for name in names:
        array = np.asarray(batch[name])
        share = len(array) // placement.world_size  # a preference batch's pair arrays: theirs
        array = array[placement.rank * share : (placement.rank + 1) * share]
        array = array.astype(np.float32 if array.dtype.kind == "f" else np.int64)
        tensor = torch.from_numpy(array).to(placement.device)
        out[name] = tensor.reshape(micro_batches, share // micro_batches, *array.shape[1:])
    return out


def used_columns(attention_mask: torch.Tensor) -> slice:
    """The columns from the first to the last that some row of ``[rows, L]`` attends to.

    The columns outside hold padding in every row: no loss weight, nothing attended, and
    position ids count from each row's first real token, so a forward without them gives
    the same numbers at less cost (eager torch runs each micro-batch at its own width).
    """
    used = torch.nonzero(attention_mask.any(dim=0)).flatten()
    if len(used) == 0:
        return slice(0, attention_mask.shape[1])
    return slice(int(used[0]), int(used[-1]) + 1)


def without_padding_columns(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch of ``[rows, L]`` arrays cut to :func:`used_columns`."""
    columns = used_columns(micro["attention_mask"])
    return {name: value[:, columns] for name, value in micro.items()}


class Trainer:
    """Owns an optimizer over trainable parameters and runs updates.

    ``params`` defaults to every parameter of ``loaded.model`` that requires grad;
    ``modules`` (default: the model) are the FSDP roots whose gradient sync is deferred to
    the last micro-batch.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        optim: OptimConfig,
        *,
        total_steps: int,
        seed: int = 0,
        params: list[torch.nn.Parameter] | None = None,
        modules: Sequence[torch.nn.Module] | None = None,
    ):
        self.loaded = loaded
        self.optim = optim
        self.total_steps = total_steps
        self.seed = seed
        if params is None:
            params = [p for p in loaded.model.parameters() if p.requires_grad]
        self.params = params
        if not self.params:
            raise ConfigError("the model has no trainable parameters")
        self.modules = list(modules) if modules is not None else [loaded.model]
        self.optimizer = make_optimizer(self.params, optim)
        self.updates = 0  # optimizer updates applied so far: the schedule's clock

    def _reseed(self) -> None:
        """Seed in-step randomness (dropout) from (seed, update, rank)."""
        seed = np.random.SeedSequence([self.seed, self.updates, self.loaded.placement.rank])
        torch.manual_seed(int(seed.generate_state(1)[0]))

    def _sync_gradients(self, now: bool) -> None:
        for module in self.modules:
            if isinstance(module, FSDPModule):  # reduce-scatter once, after the last one
                module.set_requires_gradient_sync(now)

    def accumulate(
        self,
        batch: Mapping[str, np.ndarray],
        names: Sequence[str],
        micro_batches: int,
        loss_fn: MicroLoss,
        *,
        dropout: bool = False,
        cut: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> tuple[float, dict[str, float]]:
        """Backpropagate ``loss_fn`` over this rank's micro-batches of ``batch``, leaving the
        gradients in ``.grad`` (reduced over ranks; sharded for DTensors).

        ``loss_fn(micro) -> (loss, stats)`` returns sums already weighted for the whole
        global batch (its ``loss_weights``: :mod:`strop.objectives.sft`,
        :mod:`strop.objectives.ppo`), so gradients and stats just add up over micro-batches
        and ranks. Returns the global sums of the loss and of every stat (maxima for
        :data:`strop.objectives.losses.MAX_STATS`). Every array is per
        token (``[B, L]``); each micro-batch is cut to the columns its rows use
        (:func:`without_padding_columns`; ``cut``: another function of the micro-batch, for
        arrays that are not all ``[rows, L]``). ``dropout``: run the model in training mode.
        """
        cut = without_padding_columns if cut is None else cut
        local = rank_rows(batch, names, micro_batches, self.loaded.placement)
        self._reseed()
        if dropout:
            self.loaded.model.train()
        loss_sum, sums = 0.0, {}
        for micro in range(micro_batches):
            self._sync_gradients(micro == micro_batches - 1)
            loss, stats = loss_fn(cut({name: value[micro] for name, value in local.items()}))
            loss.backward()
            loss_sum += float(loss.detach())
            for name, value in stats.items():
                combine = max if name in MAX_STATS else operator.add
                sums[name] = combine(sums.get(name, 0.0), float(value.detach()))
        self.loaded.model.eval()
        placement = self.loaded.placement
        stats = {
            name: (all_reduce_max if name in MAX_STATS else all_reduce_sum)(value, placement)
            for name, value in sums.items()
        }
        return all_reduce_sum(loss_sum, placement), stats

    def apply(self, loss: float) -> tuple[float, bool]:
        """Clip, set the scheduled learning rate, step the optimizer; return the grad norm
        (before clipping) and whether the step was applied.

        A step whose ``loss`` (the global one, the same on every rank) or gradient norm is
        not finite is not applied: the gradients are dropped and parameters, optimizer
        state and the schedule's clock stay exactly as they were (as ``is_finite_step`` in
        the JAX backend). The loops then stop the run or count the skip.
        """
        norm = grad_norm(self.params)
        host_norm = float(norm)
        if not (math.isfinite(loss) and math.isfinite(host_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return host_norm, False
        if self.optim.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.optim.max_grad_norm, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.optim, self.total_steps, self.updates)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return host_norm, True

    def update(self, *accumulate_args: Any, **accumulate_kwargs: Any) -> dict[str, float]:
        """One optimizer update: :meth:`accumulate` (same arguments), then :meth:`apply`.
        Returns the global ``loss`` and stats (a stat named ``loss`` replaces it, as in the
        JAX backend's ``train.update``), ``grad_norm`` (before clipping) and ``skipped``
        (1.0 when the loss or gradient norm was not finite and the update was not
        applied)."""
        loss, stats = self.accumulate(*accumulate_args, **accumulate_kwargs)
        grad_norm, applied = self.apply(loss)
        return {"loss": loss, "grad_norm": grad_norm, "skipped": float(not applied), **stats}
