"""The preference optimisation loop (``strop dpo``), backend-neutral.

The run skeleton is SFT's (:func:`strop.run.job.train_policy`: the data read first, then
:func:`strop.run.job.run_steps`: resume, checkpoints, metrics, the adapter's export); a step is
:class:`DpoSteps`'. Batch
``step`` is a pure function of the seed and the step (the pairs' order is
:class:`~strop.data.batching.SftBatcher`'s), so a run resumes exactly. A step lays its pairs
out as ``dpo.batch_size / dpo.micro_batch_size`` shared-prompt layouts
(:func:`strop.batch.pairs.lay_out_chunks`), forwards them once with the adapters off (full
fine-tuning: a frozen copy of the starting weights) for the reference's log-probabilities
(losses that read a reference), then once more, with the gradient, in the backend's update
(``Policy.train_pairs``). With ``data.eval_path``, the held-out pairs are scored every
``dpo.eval_every`` steps and at the last (:mod:`strop.dpo.evaluate`: ``eval/dpo/*``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from strop.backends.base import Policy
from strop.batch.pairs import lay_out_chunks
from strop.config import Config
from strop.data import Tokenizer
from strop.data.batching import SftBatcher
from strop.data.preferences import load_preference_pairs
from strop.dpo.evaluate import EVAL_PREFIX, PairEvaluator
from strop.errors import ConfigError
from strop.objectives.preference import STATS, PreferenceObjective
from strop.run.job import PolicySteps, RunResult, train_policy
from strop.run.kinds import run_kind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DpoResult(RunResult):
    """What a finished (or stopped) run produced."""

    losses: list[float] = field(default_factory=list)  # dpo/loss per step run in this call


def check_dpo(config: Config) -> None:
    """What ``strop dpo`` refuses before anything loads (one line each)."""
    if config.model.path is None or config.data.train_path is None:
        raise ConfigError("strop dpo needs model.path and data.train_path (preference pairs)")
    dpo = config.dpo
    if dpo.reference_adapter is not None and not config.lora.enabled:
        raise ConfigError(
            f"dpo.reference={dpo.reference} is a frozen adapter on the base: it needs "
            "lora.enabled=true (with full fine-tuning the reference is dpo.reference=base, "
            "a frozen copy of model.path)"
        )
    if dpo.reference_adapter is not None and not Path(dpo.reference_adapter).is_dir():
        raise ConfigError(
            f"dpo.reference={dpo.reference}: {dpo.reference_adapter} is not a directory "
            "(a PEFT adapter's, e.g. <sft run_dir>/adapter)"
        )
    data = config.data
    if dpo.eval_every and not data.eval_path:
        raise ConfigError(
            "dpo.eval_every > 0 needs data.eval_path (held-out pairs); set dpo.eval_every=0 "
            "to train without evaluation"
        )
    if data.chosen_key == data.rejected_key:
        raise ConfigError(
            f"data.chosen_key and data.rejected_key are both {data.chosen_key!r}: a pair's "
            "two answers are two columns"
        )
    if config.dpo.reference == "base" and config.lora.restore_path:
        raise ConfigError(
            f"lora.restore_path ({config.lora.restore_path}) with dpo.reference=base: the "
            "reference would be the base model, not the adapter the run starts from: set "
            f"dpo.reference=adapter:{config.lora.restore_path}"
        )


def run_dpo(config: Config, *, stop_after: int | None = None) -> DpoResult:
    """Train ``config.dpo.steps`` steps (or until ``stop_after``), resuming if possible;
    writes what ``strop sft`` writes, with the ``dpo/*`` statistics in the metrics."""
    check_dpo(config)
    figures = {"loss": "loss {:.4f}", "accuracy": "accuracy {:.0%}"}
    run, policy = train_policy(config, run_kind("dpo"), figures, partial(_read, config), stop_after)
    return DpoResult.of(config, run, policy, losses=[rec["dpo/loss"] for rec in run.records])


def _read(config: Config, tokenizer: Tokenizer) -> Callable[[Policy], DpoSteps]:
    """The preference pairs in their order (and ``data.eval_path``'s, to score): the steps
    of a policy (:func:`strop.run.job.train_policy`)."""
    data = config.data
    pairs, stats = load_preference_pairs(data.train_path, data, tokenizer)
    logger.info(
        "preference data: %d pairs, %d prompt and %d answer tokens",
        len(pairs), stats.num_prompt_tokens, stats.num_answer_tokens,
    )  # fmt: skip
    # the batcher orders the pairs (a pure function of seed and step); each "example" is a
    # pair's three id arrays
    order = SftBatcher([pair.ids for pair in pairs], config.dpo.batch_size, seed=config.seed,
                       shuffle=data.shuffle, max_length=3)  # fmt: skip
    evaluator = None
    if data.eval_path:  # read before the model loads: a bad record is refused first
        held_out, _ = load_preference_pairs(data.eval_path, data, tokenizer)
        logger.info("held-out data: %d pairs", len(held_out))
        ids = [pair.ids for pair in held_out]
        evaluator = PairEvaluator.of(config, ids, tokenizer.pad_token_id)

    def steps(policy: Policy) -> DpoSteps:
        if config.dpo.objective().needs_reference:  # before a checkpoint is restored
            policy.prepare_reference()  # full fine-tuning: a frozen copy of the model
        return DpoSteps(config, policy, order, tokenizer.pad_token_id, evaluator)

    return steps


@dataclass
class DpoSteps(PolicySteps):
    """One preference update per batch of pairs (:class:`strop.run.job.Steps`)."""

    order: SftBatcher
    pad_id: int
    evaluator: PairEvaluator | None = None  # data.eval_path's pairs
    always_written: tuple[str, ...] = (EVAL_PREFIX + "dpo/loss",)

    @property
    def objective(self) -> PreferenceObjective:
        return self.config.dpo.objective()

    def figures(self, record: Mapping[str, float]) -> dict[str, float]:
        return {"loss": record["dpo/loss"], "accuracy": record["dpo/reward_accuracy"]}

    def batch(self, step: int) -> tuple[dict[str, np.ndarray], int]:
        """Step ``step``'s pairs laid out in micro-batches, and how many there are."""
        dpo = self.config.dpo
        chunks = dpo.batch_size // dpo.micro_batch_size
        pairs = [self.order.examples[i] for i in self.order.indices(step)]
        batch = lay_out_chunks(
            pairs, chunks, columns=self.config.data.max_length, pad_id=self.pad_id,
            buckets=self.config.backend == "jax",  # a few shapes to compile
        )  # fmt: skip
        return batch, chunks

    def step(self, step: int) -> dict[str, float]:
        objective = self.objective
        began = time.perf_counter()
        batch, chunks = self.batch(step)
        if objective.needs_reference:  # once per batch, adapters off, no gradient
            chosen, rejected = self.model.pair_logps(batch, chunks, reference=True)
            batch.update(ref_chosen_logps=chosen, ref_rejected_logps=rejected)
        metrics = self.model.train_pairs(batch, chunks, objective)
        seconds = time.perf_counter() - began
        self.count_skipped(metrics, f"dpo step {step + 1}")
        tokens = float(batch["chosen_tokens"].sum() + batch["rejected_tokens"].sum())
        record = {
            **{name: metrics[name] for name in STATS},
            **self.update_record(
                metrics, tokens=tokens, epoch=self.order.epoch_of(step), seconds=seconds
            ),
        }
        if self.evaluator is not None and self.evaluator.due(step + 1, self.config.dpo.steps):
            record.update(self.evaluator(self.model, objective))  # held-out pairs, no gradient
        return record
