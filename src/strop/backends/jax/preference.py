"""The JAX backend's preference (DPO) computations: each answer's log-probability sum from one
forward over a pair layout, and the preference update, jitted.

A batch comes as :func:`strop.batch.pairs.lay_out_chunks` gives it: ``chunks`` equal pair
layouts (the micro-batches) stacked on every array's leading axis. A layout is forwarded
once (its rows packed with segment ids and ``positions``, as PPO's packed batches), and
:func:`strop.objectives.preference.pair_logps` / ``preference_micro_loss``, written once
for both backends, turn the logits into the per-pair sums and the weighted loss. The
update is :func:`strop.backends.jax.train.update` (SFT's accumulate-and-apply, with its
non-finite guard) of :func:`preference_loss`. The reference is PPO's
(:func:`~strop.backends.jax.lora.initial_reference`): the base with the adapters off is the
policy with a zero adapter (``x W + x A B`` with ``A = B = 0`` is the base's ``x W``),
``dpo.reference: adapter:DIR`` that adapter's weights in the same tree, frozen, and with
full fine-tuning a copy of the starting weights (PPO's ``copy``: :func:`prepare_reference`
before a checkpoint is restored).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from strop.backends.jax.lora import initial_reference
from strop.backends.jax.losses import OPS
from strop.backends.jax.train import jit_update, put_micro_batches, with_router_loss
from strop.batch.pairs import PAIR_COLUMNS
from strop.objectives import preference
from strop.objectives.preference import REFERENCE_INPUTS, PreferenceObjective

if TYPE_CHECKING:
    from strop.backends.jax.policy import JaxPolicy


def _logits(graphdef, trainable, frozen, micro) -> jax.Array:
    model = nnx.merge(graphdef, trainable, frozen)
    return model(micro["input_ids"], micro["attention_mask"], micro["positions"]).logits


@partial(jax.jit, static_argnums=(0,))
def pair_logps(graphdef, trainable, frozen, micro) -> tuple[jax.Array, jax.Array]:
    """``([P], [P])``: the chosen and rejected answers' log-probability sums of one layout."""
    logits = _logits(graphdef, trainable, frozen, micro)
    token_logps = OPS.token_logprobs(logits, micro["input_ids"], 1.0)
    return preference.pair_logps(OPS, token_logps, micro)


def preference_loss(
    graphdef: nnx.GraphDef, objective: PreferenceObjective, trainable, frozen, micro
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A layout's weighted preference loss and ``dpo/*`` stats (plus
    :func:`~strop.backends.jax.train.with_router_loss`), for
    :func:`~strop.backends.jax.train.update`."""
    model = nnx.merge(graphdef, trainable, frozen)
    output = model(micro["input_ids"], micro["attention_mask"], micro["positions"])
    loss, stats = preference.preference_micro_loss(OPS, output.logits, micro, objective)
    return with_router_loss(model, output, loss, stats, micro)


def forward_pair_logps(
    policy: JaxPolicy, batch: dict[str, np.ndarray], chunks: int, *, reference: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The chosen and rejected sums ``[chunks * P]`` of a stacked batch, one forward per
    chunk, without gradient; ``reference``: with the adapters off (LoRA's base), or the
    frozen copy (full fine-tuning)."""
    arrays = put_micro_batches(batch, PAIR_COLUMNS, chunks, policy.mesh)
    graphdef, trainable, frozen = nnx.split(policy.model, policy.trainable, ...)
    if reference:
        trainable = prepare_reference(policy)
    sums = [
        pair_logps(graphdef, trainable, frozen, {name: value[c] for name, value in arrays.items()})
        for c in range(chunks)
    ]
    chosen, rejected = (np.concatenate([np.asarray(s[i]) for s in sums]) for i in (0, 1))
    return chosen, rejected


def prepare_reference(policy: JaxPolicy):
    """The reference's trainable-shaped part, made once: a zero adapter, the frozen
    ``dpo.reference: adapter:DIR``, or (full fine-tuning) a copy of the weights as they are
    now: the DPO loop makes it before a checkpoint is restored, so that it is the
    starting weights (:func:`~strop.backends.jax.lora.initial_reference`, PPO's)."""
    if "_dpo_reference" not in policy.__dict__:
        path = policy.config.dpo.reference_adapter
        kind = "copy" if not policy.config.lora.enabled else "adapter" if path else "base"
        plan = SimpleNamespace(reference=kind, reference_adapter=path)
        graphdef, trainable, frozen = nnx.split(policy.model, policy.trainable, ...)
        policy.__dict__["_dpo_reference"] = initial_reference(
            graphdef, trainable, frozen, policy.config, plan
        )
    return policy.__dict__["_dpo_reference"]


def train_pairs(
    policy: JaxPolicy, batch: dict[str, np.ndarray], chunks: int, objective: PreferenceObjective
) -> dict[str, Any]:
    """One optimizer step of ``objective`` over a stacked batch (``chunks`` micro-batches;
    the reference's sums in ``ref_chosen_logps`` / ``ref_rejected_logps`` when the loss
    reads them): ``loss``, ``grad_norm``, ``skipped`` and the ``dpo/*`` stats."""
    names = PAIR_COLUMNS + (REFERENCE_INPUTS if objective.needs_reference else ())
    arrays = put_micro_batches(batch, names, chunks, policy.mesh)
    trainer = policy.trainer
    updates = policy.__dict__.setdefault("_preference_updates", {})
    if objective not in updates:
        updates[objective] = jit_update(
            trainer.tx, partial(preference_loss, trainer.graphdef, objective),
            on_trace=trainer.traces.record, name="dpo_update",
        )  # fmt: skip
    return trainer.run(updates[objective], arrays)
