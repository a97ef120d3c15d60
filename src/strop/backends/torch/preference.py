"""The torch backend's preference pairs (``strop dpo``): a pair layout over the policy's forward.

The same shape as :mod:`strop.backends.jax.preference`. A batch comes as
:func:`strop.batch.pairs.lay_out_chunks` gives it: ``chunks`` equal pair layouts (the
micro-batches of every rank, in order) stacked on every array's leading axis, so that
:func:`~strop.backends.torch.train.rank_rows` gives each rank its own. Each layout is a
few packed rows (segment ids in ``attention_mask``, plus ``positions``), cut to the
columns its rows use, so scoring it is one forward of the policy over given rows
(:meth:`~strop.backends.torch.policy.TorchPolicy.token_logprobs`: the trained weights or
the frozen reference, the policy's to hold) and
:func:`strop.objectives.preference.pair_logps`, written once for both backends, to sum
each answer's tokens. The update is the policy's SFT :class:`Trainer` of
``preference_micro_loss`` over the policy's logits
(:meth:`~strop.backends.torch.policy.TorchPolicy.packed_logits`).
:class:`PreferencePairs` is that layout-to-forward plumbing and nothing else: it sees the
policy only through the forwards, the trainer and the placement it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from strop.backends.torch.fsdp import Placement, all_gather_rows
from strop.backends.torch.losses import OPS
from strop.backends.torch.train import Trainer, rank_rows, used_columns
from strop.batch.pairs import PAIR_COLUMNS
from strop.objectives import preference
from strop.objectives.preference import REFERENCE_INPUTS, PreferenceObjective

TokenLogprobs = Callable[..., torch.Tensor]
"""``token_logprobs(micro, *, reference=False) -> [R, W]``: the policy's per-token
log-probabilities of a layout's packed rows, without gradient."""


def without_unused_columns(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layout cut to the columns some row attends to (row arrays ``[R, W]`` and masks
    ``[P, R, W]`` on their last axis; per-pair arrays as they are)."""
    columns = used_columns(micro["attention_mask"])
    return {
        name: value[..., columns] if value.ndim >= 2 else value for name, value in micro.items()
    }


class PreferencePairs:
    """Pair layouts scored and trained on through a policy's forwards: ``token_logprobs``
    (no gradient, trained weights or reference), ``logits`` (the trained weights', with
    gradient), ``trainer`` (the update) and ``placement`` (each rank's layouts)."""

    def __init__(
        self,
        token_logprobs: TokenLogprobs,
        logits: Callable[[dict[str, torch.Tensor]], torch.Tensor],
        trainer: Trainer,
        placement: Placement,
    ):
        self.token_logprobs = token_logprobs
        self.logits = logits
        self.trainer = trainer
        self.placement = placement

    def logps(
        self, batch: dict[str, np.ndarray], chunks: int, *, reference: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The chosen and rejected sums ``[chunks * P]`` of a stacked batch, one forward per
        chunk (each rank its own, gathered), without gradient (``reference``: the policy's
        frozen reference)."""
        local = rank_rows(batch, PAIR_COLUMNS, chunks // self.placement.world_size, self.placement)
        sums = []
        for c in range(len(local["input_ids"])):
            micro = without_unused_columns({name: value[c] for name, value in local.items()})
            token_logps = self.token_logprobs(micro, reference=reference)
            sums.append(preference.pair_logps(OPS, token_logps, micro))
        chosen, rejected = (
            all_gather_rows(torch.cat([s[i].float() for s in sums]), self.placement).cpu().numpy()
            for i in (0, 1)
        )
        return chosen, rejected

    def train(
        self, batch: dict[str, np.ndarray], chunks: int, objective: PreferenceObjective
    ) -> dict[str, Any]:
        """One optimizer step of ``objective`` over a stacked batch (``chunks``
        micro-batches over all ranks; the reference's sums in ``ref_chosen_logps`` /
        ``ref_rejected_logps`` when the loss reads them): ``loss``, ``grad_norm``,
        ``skipped`` and the ``dpo/*`` stats."""
        names = PAIR_COLUMNS + (REFERENCE_INPUTS if objective.needs_reference else ())

        def micro_loss(micro: dict[str, torch.Tensor]):
            return preference.preference_micro_loss(OPS, self.logits(micro), micro, objective)

        micro_batches = chunks // self.placement.world_size
        return self.trainer.update(
            batch, names, micro_batches, micro_loss, dropout=True, cut=without_unused_columns
        )
