"""The supervised fine-tuning loop, backend-neutral.

Data position is the step number (batches are a pure function of seed and step), so a
run resumes exactly from its latest complete checkpoint: same batches, same optimizer
state, same losses as an uninterrupted run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

from strop.backends.base import Policy
from strop.config import Config
from strop.data import Tokenizer, load_sft_examples, make_sft_batcher
from strop.data.batching import SftBatcher
from strop.errors import ConfigError
from strop.run.job import PolicySteps, RunResult, train_policy
from strop.run.kinds import run_kind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SftResult(RunResult):
    """What a finished (or stopped) run produced."""

    losses: list[float] = field(default_factory=list)  # per step run in this call


def run_sft(config: Config, *, stop_after: int | None = None) -> SftResult:
    """Train ``config.sft.steps`` steps (or until ``stop_after``), resuming if possible.

    Writes ``metrics.jsonl``, TensorBoard logs and checkpoints under ``config.run_dir``;
    at the end exports the adapter (LoRA) or the model (full fine-tuning). A step whose
    loss or gradient norm is NaN/Inf is never applied: it stops the run with
    :class:`~strop.errors.NonFiniteError` before anything is saved, or with
    ``train.skip_nonfinite`` is skipped and counted in ``train/nonfinite_skipped``
    (cumulative over the run, resumes included); see :mod:`strop.run.nonfinite`.
    """
    if config.model.path is None or config.data.train_path is None:
        raise ConfigError("strop sft needs model.path and data.train_path")
    if config.sft.eval_every and not config.data.eval_path:
        raise ConfigError(
            "sft.eval_every > 0 needs data.eval_path (held-out data); set sft.eval_every=0 "
            "to train without evaluation"
        )
    figures = {"loss": "loss {:.4f}", "tokens_per_s": "{:,.0f} tok/s"}
    run, policy = train_policy(config, run_kind("sft"), figures, partial(_read, config), stop_after)
    return SftResult.of(config, run, policy, losses=[rec["train/loss"] for rec in run.records])


def _read(config: Config, tokenizer: Tokenizer) -> Callable[[Policy], SftSteps]:
    """The training data's batches (and with ``sft.eval_every`` the held-out data's): the
    steps of a policy (:func:`strop.run.job.train_policy`)."""
    sft = config.sft
    train_examples, stats = load_sft_examples(config.data.train_path, config.data, tokenizer)
    logger.info(
        "train data: %d examples, %d loss tokens", stats.num_examples, stats.num_loss_tokens
    )
    batcher = make_sft_batcher(train_examples, config.data, tokenizer, sft.batch_size, config.seed)
    eval_batcher = None
    if config.data.eval_path and sft.eval_every:
        eval_examples, _ = load_sft_examples(config.data.eval_path, config.data, tokenizer)
        eval_batcher = make_sft_batcher(
            eval_examples, config.data, tokenizer, sft.micro_batch_size, config.seed
        )
    return lambda policy: SftSteps(config, policy, batcher, eval_batcher)


@dataclass
class SftSteps(PolicySteps):
    """One SFT step per batch (:class:`strop.run.job.Steps`)."""

    batcher: SftBatcher
    eval_batcher: SftBatcher | None
    always_written: tuple[str, ...] = ("eval/loss",)

    def figures(self, record: Mapping[str, float]) -> dict[str, float]:
        return {"loss": record["train/loss"], "tokens_per_s": record["throughput/tokens_per_s"]}

    def step(self, step: int) -> dict[str, float]:
        sft = self.config.sft
        began = time.perf_counter()
        metrics = self.model.train_step(
            self.batcher.batch(step), sft.batch_size // sft.micro_batch_size
        )
        seconds = time.perf_counter() - began
        done = step + 1
        self.count_skipped(metrics, f"sft step {done}")
        record = {
            "train/loss": metrics["loss"],
            **self.update_record(
                metrics, tokens=metrics["tokens"], epoch=self.batcher.epoch_of(step),
                seconds=seconds,
            ),
        }  # fmt: skip
        if self.eval_batcher is not None and done % sft.eval_every == 0:
            record["eval/loss"] = _eval_loss(self.model, self.eval_batcher, sft.micro_batch_size)
        return record


def _eval_loss(policy, batcher, batch_size: int) -> float:
    """Mean loss per target token over the whole eval set."""
    total = count = 0.0
    for batch, _ in batcher.iter_eval_batches(batch_size):
        batch_total, batch_count = policy.eval_loss(batch)
        total, count = total + batch_total, count + batch_count
    return total / max(count, 1.0)
