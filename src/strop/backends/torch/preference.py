"""The torch backend's preference (DPO) computations: each answer's log-probability sum from one
forward over a pair layout, and the preference update.

The same surface as :mod:`strop.backends.jax.preference`. A batch comes as
:func:`strop.batch.pairs.lay_out_chunks` gives it: ``chunks`` equal pair layouts (the
micro-batches of every rank, in order) stacked on every array's leading axis, so that
:func:`~strop.backends.torch.train.rank_rows` gives each rank its own. A layout is
forwarded once (packed rows: segment ids in ``attention_mask``, plus ``positions``), cut
to the columns its rows use, and :func:`strop.objectives.preference.pair_logps` /
``preference_micro_loss`` (written once for both backends) turn the logits into the
per-pair sums and the weighted loss; the update is the SFT :class:`Trainer`'s. The
reference (LoRA) is the base with the adapters disabled (:func:`use_adapter`), or with
``dpo.reference: adapter:DIR`` that adapter, loaded frozen beside the trained one
(:func:`reference_adapters`, :func:`load_reference`), as PPO's reference adapter. With full
fine-tuning it is PPO's frozen copy of ``model.path`` (:func:`prepare_reference`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from strop.backends.torch.fsdp import all_gather_rows
from strop.backends.torch.lora import adapter_params, set_adapter_weights, use_adapter
from strop.backends.torch.losses import OPS
from strop.backends.torch.model import LoadedModel, forward_logits, frozen_copy
from strop.backends.torch.train import rank_rows, used_columns
from strop.batch.pairs import PAIR_COLUMNS
from strop.config import Config
from strop.io.peft import read_adapter_for
from strop.objectives import preference
from strop.objectives.preference import REFERENCE_INPUTS, PreferenceObjective

if TYPE_CHECKING:
    from strop.backends.torch.policy import TorchPolicy


REFERENCE_ADAPTER = "reference"


def reference_adapters(config: Config) -> tuple[str, ...]:
    """The adapters to build beside the trained one: the reference's, with
    ``dpo.reference: adapter:DIR``."""
    return (REFERENCE_ADAPTER,) if config.lora.enabled and config.dpo.reference_adapter else ()


def load_reference(loaded: LoadedModel, config: Config) -> None:
    """Put ``dpo.reference: adapter:DIR``'s weights into the reference adapter, frozen
    (before the trainer lists what trains)."""
    if not reference_adapters(config):
        return
    path = config.dpo.reference_adapter
    weights = read_adapter_for(path, config.lora, config.model.path)
    set_adapter_weights(loaded.model, weights, str(path), REFERENCE_ADAPTER)
    for param in adapter_params(loaded.model, REFERENCE_ADAPTER):
        param.requires_grad_(False)


def prepare_reference(policy: TorchPolicy) -> LoadedModel | None:
    """Full fine-tuning's reference, built once (PPO's :func:`frozen_copy` of
    ``model.path``: the starting weights whatever a checkpoint restores); None with LoRA,
    whose reference is the base (or an adapter) in the policy's own model."""
    if policy.config.lora.enabled:
        return None
    if "reference_loaded" not in policy.__dict__:
        policy.__dict__["reference_loaded"] = frozen_copy(policy.config, policy.placement)
    return policy.__dict__["reference_loaded"]


def without_unused_columns(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layout cut to the columns some row attends to (row arrays ``[R, W]`` and masks
    ``[P, R, W]`` on their last axis; per-pair arrays as they are)."""
    columns = used_columns(micro["attention_mask"])
    return {
        name: value[..., columns] if value.ndim >= 2 else value for name, value in micro.items()
    }


def _logits(loaded: LoadedModel, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    return forward_logits(loaded, micro["input_ids"], micro["attention_mask"], micro["positions"])


def pair_logps(loaded: LoadedModel, micro: dict[str, torch.Tensor]):
    """``([P], [P])``: the chosen and rejected answers' log-probability sums of one layout."""
    micro = without_unused_columns(micro)
    token_logps = OPS.token_logprobs(_logits(loaded, micro), micro["input_ids"], 1.0)
    return preference.pair_logps(OPS, token_logps, micro)


def forward_pair_logps(
    policy: TorchPolicy, batch: dict[str, np.ndarray], chunks: int, *, reference: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The chosen and rejected sums ``[chunks * P]`` of a stacked batch, one forward per
    chunk (each rank its own, gathered), without gradient; ``reference``: with the
    adapters disabled (LoRA's base), or the frozen copy (full fine-tuning)."""
    placement = policy.placement
    local = rank_rows(batch, PAIR_COLUMNS, chunks // placement.world_size, placement)
    active = REFERENCE_ADAPTER if reference_adapters(policy.config) else None
    loaded = (reference and prepare_reference(policy)) or policy.loaded
    lora = reference and policy.config.lora.enabled
    adapter = use_adapter(policy.model, active) if lora else nullcontext()
    with torch.no_grad(), adapter:
        sums = [
            pair_logps(loaded, {name: value[c] for name, value in local.items()})
            for c in range(len(local["input_ids"]))
        ]
    chosen, rejected = (
        all_gather_rows(torch.cat([s[i].float() for s in sums]), placement).cpu().numpy()
        for i in (0, 1)
    )
    return chosen, rejected


def train_pairs(
    policy: TorchPolicy, batch: dict[str, np.ndarray], chunks: int, objective: PreferenceObjective
) -> dict[str, Any]:
    """One optimizer step of ``objective`` over a stacked batch (``chunks`` micro-batches
    over all ranks; the reference's sums in ``ref_chosen_logps`` / ``ref_rejected_logps``
    when the loss reads them): ``loss``, ``grad_norm``, ``skipped`` and the ``dpo/*``
    stats."""
    names = PAIR_COLUMNS + (REFERENCE_INPUTS if objective.needs_reference else ())

    def loss_fn(micro: dict[str, torch.Tensor]):
        return preference.preference_micro_loss(
            OPS, _logits(policy.loaded, micro), micro, objective
        )

    micro_batches = chunks // policy.placement.world_size
    return policy.trainer.update(
        batch, names, micro_batches, loss_fn, dropout=True, cut=without_unused_columns
    )
