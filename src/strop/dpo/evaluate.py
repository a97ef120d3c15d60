"""Held-out preference pairs (``data.eval_path``) scored during ``strop dpo``, without gradient.

Every ``dpo.eval_every`` steps and at the last, :class:`PairEvaluator` forwards the held-out
pairs in the training step's layout (``dpo.batch_size`` pairs as ``dpo.batch_size /
dpo.micro_batch_size`` shared-prompt layouts, :func:`strop.batch.pairs.lay_out_chunks`)
through the policy and, for a loss with a reference, through the reference (once per run:
it is frozen), then computes the loss and its statistics over all of them in float64 numpy
with the core's :func:`strop.objectives.preference.preference_loss`, the code the backends'
updates run. Each held-out pair weighs ``1 / N`` (``N`` the held-out pairs); the pairs that
fill the last layout up to ``dpo.batch_size`` weigh 0, so the numbers are the means over
the held-out pairs whatever the batch shapes. They are logged as ``eval/`` + the training
statistics' names (``eval/dpo/loss``, ``eval/dpo/reward_accuracy``, ...), as SFT logs
``eval/loss``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from strop.backends.base import Policy
from strop.batch.pairs import Pair, lay_out_chunks
from strop.config import Config
from strop.objectives.losses import ArrayOps
from strop.objectives.preference import PAIR_INPUTS, PreferenceObjective, preference_loss

EVAL_PREFIX = "eval/"
"""Held-out statistics are the training ones' names after this prefix."""


def _unused(*_):
    raise NotImplementedError("the held-out statistics read per-pair sums only")


NUMPY_OPS = ArrayOps(
    xp=np, on=lambda mask: np.asarray(mask) > 0,
    select=lambda on, x: np.where(on, np.asarray(x, np.float64), 0.0),
    indicator=lambda b: np.asarray(b, np.float64), stop_gradient=lambda x: x,
    token_logprobs=_unused, token_entropy=_unused, segment_mean=_unused,
)  # fmt: skip
"""numpy's :class:`ArrayOps`, for the preference losses on per-pair sums (no forward)."""


@dataclass
class PairEvaluator:
    """The held-out ``pairs`` (their token ids), laid out as a training step's: ``batch_size``
    pairs a batch in ``chunks`` layouts of ``columns`` unpacked columns (``buckets``: JAX's
    fixed shapes); evaluated at step ``done`` of ``total`` when :meth:`due`."""

    pairs: Sequence[Pair]
    batch_size: int
    chunks: int
    columns: int
    pad_id: int
    every: int = 0  # 0: at the last step only
    buckets: bool = False
    _reference: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ValueError("no held-out pairs to evaluate")

    @classmethod
    def of(cls, config: Config, pairs: Sequence[Pair], pad_id: int) -> PairEvaluator:
        """``pairs`` (``data.eval_path``'s) evaluated as ``config``'s steps lay pairs out,
        every ``dpo.eval_every`` steps and at the last."""
        dpo = config.dpo
        return cls(
            pairs, dpo.batch_size, dpo.batch_size // dpo.micro_batch_size,
            columns=config.data.max_length, pad_id=pad_id, every=dpo.eval_every,
            buckets=config.backend == "jax",  # the training step's few shapes
        )  # fmt: skip

    def due(self, done: int, total: int) -> bool:
        """Whether the held-out pairs are scored after step ``done`` (1-based) of ``total``."""
        return done == total or (self.every > 0 and done % self.every == 0)

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        """The held-out pairs, ``batch_size`` at a time, the last batch filled up with copies
        of the first pair (weighed 0 by :meth:`__call__`)."""
        pairs = list(self.pairs)
        pairs += [pairs[0]] * (-len(pairs) % self.batch_size)
        for start in range(0, len(pairs), self.batch_size):
            yield lay_out_chunks(
                pairs[start : start + self.batch_size], self.chunks, columns=self.columns,
                pad_id=self.pad_id, buckets=self.buckets,
            )  # fmt: skip

    def _forward(self, policy: Policy, *, reference: bool) -> dict[str, np.ndarray]:
        """Each pair's (padding pairs included) chosen and rejected log-probability sums
        (``reference``: the reference's) and token counts, float64."""
        columns: dict[str, list[np.ndarray]] = {name: [] for name in PAIR_INPUTS}
        for batch in self.batches():
            chosen, rejected = policy.pair_logps(batch, self.chunks, reference=reference)
            for name, value in zip(PAIR_INPUTS, (chosen, rejected, batch["chosen_tokens"],
                                                 batch["rejected_tokens"]), strict=True):  # fmt: skip
                columns[name].append(np.asarray(value, np.float64))
        return {name: np.concatenate(values) for name, values in columns.items()}

    def __call__(self, policy: Policy, objective: PreferenceObjective) -> dict[str, float]:
        """``objective``'s loss and statistics over the held-out pairs (``eval/dpo/*``)."""
        inputs = self._forward(policy, reference=False)
        if objective.needs_reference:
            if self._reference is None:  # frozen: the same sums at every evaluation
                ref = self._forward(policy, reference=True)
                self._reference = ref["chosen_logps"], ref["rejected_logps"]
            inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = self._reference
        n, padded = len(self.pairs), len(inputs["chosen_logps"])
        weights = np.where(np.arange(padded) < n, 1.0 / n, 0.0)
        _, stats = preference_loss(NUMPY_OPS, inputs, weights, objective)
        return {EVAL_PREFIX + name: float(value) for name, value in stats.items()}
