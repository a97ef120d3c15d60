"""The JAX backend's preference pairs (``strop dpo``): a pair layout over the policy's forward.

A batch comes as :func:`strop.batch.pairs.lay_out_chunks` gives it: ``chunks`` equal pair
layouts (the micro-batches) stacked on every array's leading axis. Each layout is a few
packed rows (segment ids in ``attention_mask``, plus ``positions``, as PPO's packed
batches), so scoring it is one forward of the policy over given rows
(:meth:`~strop.backends.jax.policy.JaxPolicy.token_logprobs`: the trained weights or the
frozen reference, the policy's to hold) and
:func:`strop.objectives.preference.pair_logps`, written once for both backends, to sum
each answer's tokens. The update is the policy's :class:`~strop.backends.jax.train.Trainer`
(SFT's accumulate-and-apply, with its non-finite guard) of :func:`preference_loss`.
:class:`PreferencePairs` is that layout-to-forward plumbing and nothing else: it sees the
policy only through the forward, the trainer and the mesh it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from strop.backends.jax.losses import OPS
from strop.backends.jax.train import Trainer, put_micro_batches, with_router_loss
from strop.batch.pairs import PAIR_COLUMNS
from strop.objectives import preference
from strop.objectives.preference import REFERENCE_INPUTS, PreferenceObjective

TokenLogprobs = Callable[..., jax.Array]
"""``token_logprobs(micro, *, reference=False) -> [R, W]``: the policy's per-token
log-probabilities of a layout's packed rows, without gradient."""


@jax.jit
def _answer_sums(token_logps: jax.Array, micro: dict[str, jax.Array]):
    return preference.pair_logps(OPS, token_logps, micro)


def preference_loss(
    graphdef: nnx.GraphDef, objective: PreferenceObjective, trainable, frozen, micro
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A layout's weighted preference loss and ``dpo/*`` stats (plus
    :func:`~strop.backends.jax.train.with_router_loss`), for
    :meth:`~strop.backends.jax.train.Trainer.jit_update`."""
    model = nnx.merge(graphdef, trainable, frozen)
    output = model(micro["input_ids"], micro["attention_mask"], micro["positions"])
    loss, stats = preference.preference_micro_loss(OPS, output.logits, micro, objective)
    return with_router_loss(model, output, loss, stats, micro)


class PreferencePairs:
    """Pair layouts scored and trained on through a policy's forward: ``token_logprobs``
    (no gradient, trained weights or reference), ``trainer`` (the update) and ``mesh``
    (where the layouts go)."""

    def __init__(self, token_logprobs: TokenLogprobs, trainer: Trainer, mesh: Mesh):
        self.token_logprobs = token_logprobs
        self.trainer = trainer
        self.mesh = mesh
        self.updates: dict[PreferenceObjective, Callable] = {}  # one program per loss

    def logps(
        self, batch: dict[str, np.ndarray], chunks: int, *, reference: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The chosen and rejected sums ``[chunks * P]`` of a stacked batch, one forward per
        chunk, without gradient (``reference``: the policy's frozen reference)."""
        arrays = put_micro_batches(batch, PAIR_COLUMNS, chunks, self.mesh)
        sums = []
        for c in range(chunks):
            micro = {name: value[c] for name, value in arrays.items()}
            sums.append(_answer_sums(self.token_logprobs(micro, reference=reference), micro))
        chosen, rejected = (np.concatenate([np.asarray(s[i]) for s in sums]) for i in (0, 1))
        return chosen, rejected

    def train(
        self, batch: dict[str, np.ndarray], chunks: int, objective: PreferenceObjective
    ) -> dict[str, Any]:
        """One optimizer step of ``objective`` over a stacked batch (``chunks``
        micro-batches; the reference's sums in ``ref_chosen_logps`` / ``ref_rejected_logps``
        when the loss reads them): ``loss``, ``grad_norm``, ``skipped`` and the ``dpo/*``
        stats."""
        names = PAIR_COLUMNS + (REFERENCE_INPUTS if objective.needs_reference else ())
        arrays = put_micro_batches(batch, names, chunks, self.mesh)
        if objective not in self.updates:
            self.updates[objective] = self.trainer.jit_update(
                preference_loss, objective, name="dpo_update"
            )
        return self.trainer.run(self.updates[objective], arrays)
