"""The supervised fine-tuning loop, backend-neutral.

Data position is the step number (batches are a pure function of seed and step), so a
run resumes exactly from its latest complete checkpoint: same batches, same optimizer
state, same losses as an uninterrupted run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from strop.backends import get_backend
from strop.config import Config
from strop.data import Tokenizer, load_sft_examples, make_sft_batcher
from strop.errors import ConfigError
from strop.interrupts import deferred_interrupts
from strop.job import training_job
from strop.metrics import MetricsWriter
from strop.nonfinite import CHECKPOINT_KEY, count_skipped
from strop.preflight import preflight
from strop.progress import RunProgress

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SftResult:
    """What a finished run produced."""

    run_dir: Path
    final_step: int
    resumed_from: int | None
    losses: list[float]
    export_path: Path | None
    is_main: bool = True  # False on every process but the first of a distributed run


def run_sft(config: Config, *, stop_after: int | None = None) -> SftResult:
    """Train ``config.sft.steps`` steps (or until ``stop_after``), resuming if possible.

    Writes ``metrics.jsonl``, TensorBoard logs and checkpoints under ``config.run_dir``;
    at the end exports the adapter (LoRA) or the model (full fine-tuning). A step whose
    loss or gradient norm is NaN/Inf is never applied: it stops the run with
    :class:`~strop.errors.NonFiniteError` before anything is saved, or with
    ``train.skip_nonfinite`` is skipped and counted in ``train/nonfinite_skipped``
    (cumulative over the run, resumes included); see :mod:`strop.nonfinite`.
    """
    if config.model.path is None or config.data.train_path is None:
        raise ConfigError("strop sft needs model.path and data.train_path")
    if config.sft.eval_every and not config.data.eval_path:
        raise ConfigError(
            "sft.eval_every > 0 needs data.eval_path (held-out data); set sft.eval_every=0 "
            "to train without evaluation"
        )
    preflight(config, "sft", config.checkpoint_path())  # before anything loads
    figures = {"loss": "loss {:.4f}", "tokens_per_s": "{:,.0f} tok/s"}
    with training_job(config, "sft", config.sft.steps, figures) as progress:
        return _train(config, stop_after, progress)


def _train(config: Config, stop_after: int | None, progress: RunProgress) -> SftResult:
    run_dir = Path(config.run_dir)
    sft = config.sft
    micro_batches = sft.batch_size // sft.micro_batch_size
    checkpoint_dir = config.checkpoint_path()

    progress.phase("reading the data")
    tokenizer = Tokenizer.from_pretrained(config.model.path)
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

    progress.phase("loading the model")
    policy = get_backend(config.backend).build_policy(
        config, total_steps=sft.steps, checkpoint_dir=checkpoint_dir
    )
    start, resumed_from, skipped = 0, policy.latest_checkpoint(), 0
    if resumed_from is not None:
        extra = policy.restore_checkpoint(resumed_from)
        start = int(extra["step"])
        skipped = int(extra.get(CHECKPOINT_KEY, 0))
        logger.info("resumed from checkpoint step %d in %s", start, run_dir)
        progress.resumed_at(start)
        if config.lora.restore_path:
            logger.info(
                "ignoring lora.restore_path on a resumed run (state comes from the checkpoint)"
            )
    elif config.lora.restore_path:
        policy.load_adapter(config.lora.restore_path)
        logger.info("initialised adapters from %s", config.lora.restore_path)

    end = sft.steps if stop_after is None else min(stop_after, sft.steps)
    losses: list[float] = []
    with MetricsWriter.for_run(config, enabled=policy.is_main, resumed_from=resumed_from) as writer:
        progress.phase("")
        for step in range(start, end):
            began = time.perf_counter()
            metrics = policy.train_step(batcher.batch(step), micro_batches)
            seconds = time.perf_counter() - began
            done = step + 1
            skipped += count_skipped(
                metrics,
                where=f"sft step {done}",
                skip=config.train.skip_nonfinite,
                latest_checkpoint=policy.latest_checkpoint,
                checkpoint_dir=str(checkpoint_dir),
            )
            losses.append(metrics["loss"])
            record = {
                "train/loss": metrics["loss"],
                "train/grad_norm": metrics["grad_norm"],
                "train/tokens": metrics["tokens"],
                "train/epoch": batcher.epoch_of(step),
                "train/nonfinite_skipped": skipped,  # cumulative over the run
                "timing/step_s": seconds,
                "throughput/tokens_per_s": metrics["tokens"] / seconds,
            }
            if eval_batcher is not None and done % sft.eval_every == 0:
                record["eval/loss"] = _eval_loss(policy, eval_batcher, sft.micro_batch_size)
            if done % config.logging.every_steps == 0 or done == end or "eval/loss" in record:
                writer.write(done, record)
            progress.update(
                done, loss=metrics["loss"], tokens_per_s=record["throughput/tokens_per_s"]
            )
            if done % config.checkpoint.every_steps == 0 or done == sft.steps:
                extra = {"step": done, "seed": config.seed, CHECKPOINT_KEY: skipped}
                with deferred_interrupts():  # a save is never cut
                    policy.save_checkpoint(done, extra)

    export_path = None
    if end == sft.steps:
        progress.phase("exporting")
        if config.lora.enabled:
            export_path = policy.export_adapter(run_dir / "adapter", overwrite=True)
        else:
            export_path = policy.export_merged(run_dir / "model", overwrite=True)
        logger.info("exported %s", export_path)
    return SftResult(run_dir, end, resumed_from, losses, export_path, policy.is_main)


def _eval_loss(policy, batcher, batch_size: int) -> float:
    """Mean loss per target token over the whole eval set."""
    total = count = 0.0
    for batch, _ in batcher.iter_eval_batches(batch_size):
        batch_total, batch_count = policy.eval_loss(batch)
        total, count = total + batch_total, count + batch_count
    return total / max(count, 1.0)
