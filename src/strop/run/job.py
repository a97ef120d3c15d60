"""The skeleton every command's run shares (``strop sft``, ``strop ppo``, ``strop eval``).

- :func:`training_job` / :func:`eval_job`: the command's preflight
  (:func:`~strop.run.preflight.preflight`, which gives the run's one ``Backend``), then what
  it holds for its whole life (a :class:`Job`): the run directory
  (:func:`~strop.run.preflight.holding_run_dir`), its progress report
  (:class:`~strop.run.progress.RunProgress`) and, for training, the Ctrl-C / SIGTERM report
  that names the checkpoint to resume from (:func:`~strop.run.interrupts.reporting_interrupts`);
- :func:`run_steps`: resume (or seed the adapter from ``lora.restore_path``), the run's
  record (``config.yaml``, ``versions.json``: once the resume succeeded), the steps,
  metrics on the logging cadence, checkpoints on theirs (never cut by Ctrl-C), and the
  final export (the adapter with LoRA, else the merged model). A command supplies only
  what one of its steps does (:class:`Steps`);
- :func:`train_policy`: SFT's and DPO's run (a :class:`Policy` trained on data read first);
  such a command supplies only its data's reading and its steps (:class:`PolicySteps`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, cast

from strop.backends.base import Backend, Policy, TrainableModel
from strop.config import Config
from strop.data import Tokenizer, policy_tokenizer
from strop.io.checkpoint_dir import refuse_step_past_the_end
from strop.io.run_record import CONFIG_FILE, record_run
from strop.metrics import MetricsWriter
from strop.run.interrupts import deferred_interrupts, reporting_interrupts
from strop.run.kinds import RunKind, run_kind
from strop.run.nonfinite import CHECKPOINT_KEY, count_skipped, likely_causes
from strop.run.preflight import RunFacts, holding_run_dir, preflight
from strop.run.progress import RunProgress, is_main_by_environment

if TYPE_CHECKING:
    from strop.engines import RolloutEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What a command holds while it runs: what preflight read (:class:`RunFacts`: the
    kind of run, the backend, the model's spec, the role plan, the checkpoints' place and
    identity, the environment factory) and the run's progress report."""

    facts: RunFacts
    progress: RunProgress

    @property
    def name(self) -> str:
        """The kind of run's name (``"sft"``, ``"ppo"``...)."""
        return self.facts.kind.name

    @property
    def backend(self) -> Backend:
        """The run's backend (its builders, ``write_once``)."""
        return self.facts.backend

    @property
    def checkpoints(self) -> Path | None:
        """A training run's checkpoint directory (``checkpoint.dir``, else
        ``<run_dir>/checkpoints``)."""
        place = self.facts.checkpoints
        return None if place is None else place.directory

    @property
    def environment(self) -> Callable[[], Any] | None:
        """``env.name``'s factory with ``env.args``, built once by preflight."""
        return self.facts.environment


@contextmanager
def training_job(config: Config, kind: RunKind, figures: Mapping[str, str]) -> Iterator[Job]:
    """Preflight a run of ``kind``, before anything loads, then hold ``config.run_dir``
    for it; its progress report shows ``figures`` (see :class:`RunProgress`)."""
    facts = preflight(config, kind)
    progress = RunProgress(
        kind.name, kind.total_steps(config), figures, enabled=is_main_by_environment()
    )
    checkpoints = facts.checkpoints.directory if facts.checkpoints is not None else None

    def step_running() -> int:
        return progress.completed + 1

    with (
        holding_run_dir(config, facts.backend, checkpoints),
        progress,
        reporting_interrupts(step_running, checkpoints, config.backend),
    ):
        yield Job(facts, progress)


@contextmanager
def eval_job(config: Config, figures: Mapping[str, str]) -> Iterator[Job]:
    """Preflight ``strop eval``, then hold ``config.run_dir`` for it; its progress report's
    total is set once the data is read."""
    facts = preflight(config, run_kind("eval"))
    progress = RunProgress("eval", 0, figures, enabled=is_main_by_environment())
    with holding_run_dir(config, facts.backend), progress:
        yield Job(facts, progress)


class Steps(Protocol):
    """What one training command does, for :func:`run_steps` to drive."""

    model: TrainableModel
    """The backend's ``Policy`` or ``ActorCritic``: checkpoints, adapter, export."""
    always_written: tuple[str, ...]
    """Metrics that are written whenever a record has them, whatever the cadence."""

    def restore_counters(self, saved: Any) -> None:
        """Set the run's counters from a checkpoint (``None`` if it has none)."""

    def counters(self) -> Any:
        """The run's counters (JSON), saved with each checkpoint."""

    def first_record(self) -> dict[str, float] | None:
        """Metrics of step 0 of a fresh run (before any update), if any."""

    def step(self, step: int) -> dict[str, float]:
        """Run step ``step`` (0-based) and return its metrics."""

    def figures(self, record: Mapping[str, float]) -> dict[str, float]:
        """The progress report's figures from a step's metrics."""


@dataclass(frozen=True)
class RunResult:
    """What a training run produced (``strop sft``, ``strop ppo``)."""

    run_dir: Path
    final_step: int  # steps done when it returned
    resumed_from: int | None
    export_path: Path | None  # <run_dir>/adapter (LoRA) or <run_dir>/model; None if unfinished
    is_main: bool = True  # False on every process but the first of a distributed run

    @classmethod
    def of(cls, config: Config, run: Finished, model: TrainableModel, **more: Any) -> Self:
        """What ``run`` (:func:`run_steps` of ``model``) produced; ``more``: a subclass's
        own fields."""
        return cls(
            run_dir=Path(config.run_dir), final_step=run.end, resumed_from=run.resumed_from,
            export_path=run.export_path, is_main=model.is_main, **more,
        )  # fmt: skip


@dataclass(frozen=True)
class Finished:
    """What :func:`run_steps` did: the steps it ran and what it exported."""

    resumed_from: int | None
    end: int  # steps done when it returned
    records: list[dict[str, float]]  # one per step run in this call
    export_path: Path | None  # set once the run's last step is done


@dataclass
class PolicySteps:
    """What SFT's and DPO's :class:`Steps` share: one ``Policy`` update a step, no step-0
    record, and ``skipped``, the non-finite steps skipped over the whole run (resumes
    included), saved with each checkpoint."""

    config: Config
    model: Policy
    skipped: int = field(default=0, kw_only=True)

    def restore_counters(self, saved: Any) -> None:
        self.skipped = int(saved or 0)

    def counters(self) -> int:
        return self.skipped

    def first_record(self) -> None:
        return None

    def count_skipped(self, metrics: dict[str, float], where: str) -> None:
        """Pop ``skipped`` from an update's ``metrics`` and count it; a non-finite update
        without ``train.skip_nonfinite`` raises (:func:`~strop.run.nonfinite.count_skipped`)."""
        config = self.config
        self.skipped += count_skipped(
            metrics,
            where=where,
            skip=config.train.skip_nonfinite,
            latest_checkpoint=self.model.latest_checkpoint,
            checkpoint_dir=str(config.checkpoint_path()),
            causes=lambda: likely_causes(config),
        )

    def update_record(
        self, metrics: Mapping[str, float], *, tokens: float, epoch: float, seconds: float
    ) -> dict[str, float]:
        """The metrics every update writes, from its ``metrics`` (``grad_norm``, and the
        stats a backend names in a namespace of their own, such as ``moe/aux_loss``, as
        they are), the target ``tokens`` it trained on, the data's ``epoch`` and the
        step's ``seconds``."""
        return {
            **{name: value for name, value in metrics.items() if "/" in name},
            "train/grad_norm": metrics["grad_norm"],
            "train/tokens": tokens,
            "train/epoch": epoch,
            "train/nonfinite_skipped": self.skipped,  # cumulative over the run
            "timing/step_s": seconds,
            "throughput/tokens_per_s": tokens / seconds,
        }


def train_policy(
    config: Config,
    kind: RunKind,
    figures: Mapping[str, str],
    read: Callable[[Tokenizer], Callable[[Policy], PolicySteps]],
    stop_after: int | None,
) -> tuple[Finished, Policy]:
    """Run a supervised ``kind`` of run (SFT, DPO) in its :func:`training_job`: ``read``
    its data with the model's tokenizer before the model loads (a bad record is refused
    first), then :func:`run_steps` of what ``read`` returned, made over the policy the
    kind builds."""
    total = kind.total_steps(config)
    with training_job(config, kind, figures) as running:  # preflight first
        running.progress.phase("reading the data")
        steps = read(policy_tokenizer(config))
        running.progress.phase("loading the model")
        policy = cast(Policy, build_trained_model(config, running.facts))
        return run_steps(config, steps(policy), running, total=total, stop_after=stop_after), policy


def build_trained_model(config: Config, facts: RunFacts) -> TrainableModel:
    """The model a run of ``facts.kind`` trains (its declaration's ``build``), with the
    schedule, role plan and checkpoints preflight read."""
    build = facts.kind.build
    if build is None:
        raise ValueError(f"strop {facts.kind.name} trains no model")
    return build(facts.backend, config, facts)


def run_steps(
    config: Config,
    steps: Steps,
    job: Job,
    *,
    total: int,
    stop_after: int | None,
    rollouts: RolloutEngine | None = None,
) -> Finished:
    """Resume ``steps.model`` from its latest checkpoint (or seed it from
    ``lora.restore_path``), record the run (``config.yaml``, ``versions.json`` of ``job``),
    run steps up to ``total`` (or ``stop_after``), and export once all ``total`` are done.
    ``rollouts``: the engine sampling ``steps.model`` (PPO), marked stale after a restore
    or a loaded adapter.

    A checkpoint past ``total`` is refused (preflight refuses it before anything loads);
    ``metrics.jsonl`` is opened only when a step runs, so a call that runs none (a finished
    run again: its export again) leaves every record where it was."""
    model, run_dir, progress = steps.model, Path(config.run_dir), job.progress
    start, resumed_from = 0, model.latest_checkpoint()
    if resumed_from is not None:
        kind = job.facts.kind
        refuse_step_past_the_end(
            resumed_from, total, config.run_dir, steps_key=str(kind.steps_key),
            step_word=kind.step_word,
        )  # fmt: skip
        extra = model.restore_checkpoint(resumed_from)
        if rollouts is not None:
            rollouts.mark_stale()
        start = int(extra["step"])
        steps.restore_counters(extra.get(CHECKPOINT_KEY))
        logger.info("resumed from checkpoint step %d in %s", start, run_dir)
        progress.resumed_at(start)
        if config.lora.restore_path:
            logger.info("ignoring lora.restore_path on a resumed run (the checkpoint has it)")
    elif config.lora.restore_path:
        model.load_adapter(config.lora.restore_path)
        if rollouts is not None:
            rollouts.mark_stale()
        logger.info("initialised the adapter from %s", config.lora.restore_path)

    where = run_dir / CONFIG_FILE
    job.backend.write_once(lambda: record_run(config, job.name), f"writing {where}")

    end = total if stop_after is None else min(stop_after, total)
    records: list[dict[str, float]] = []
    if start < end:
        _steps(config, steps, progress, range(start, end), total, resumed_from, records)
    else:
        logger.info("%s holds step %d of %d already: nothing to train", run_dir, start, total)

    export_path = None
    if end == total:
        progress.phase("exporting")
        if config.lora.enabled:
            export_path = model.export_adapter(run_dir / "adapter", overwrite=True)
        else:
            export_path = model.export_merged(run_dir / "model", overwrite=True)
        logger.info("exported %s", export_path)
    return Finished(resumed_from, end, records, export_path)


def _steps(
    config: Config,
    steps: Steps,
    progress: RunProgress,
    run: range,
    total: int,
    resumed_from: int | None,
    records: list[dict[str, float]],
) -> None:
    """Run the steps ``run`` (0-based), appending their metrics to ``records``: written on
    the logging cadence, checkpoints on theirs. Records of a killed attempt past the
    checkpoint ``resumed_from`` leave ``metrics.jsonl`` here, where they are recomputed."""
    model = steps.model
    with MetricsWriter.for_run(config, enabled=model.is_main, resumed_from=resumed_from) as writer:
        first = steps.first_record() if run.start == 0 else None
        if first is not None:
            writer.write(0, first)
            writer.write_samples(0, _samples(steps))
            progress.update(0, **steps.figures(first))
        progress.phase("")
        for step in run:
            record = steps.step(step)
            records.append(record)
            done = step + 1
            if (
                done % config.logging.every_steps == 0
                or done == run.stop
                or any(name in record for name in steps.always_written)
            ):
                writer.write(done, record)
            writer.write_samples(done, _samples(steps))
            progress.update(done, **steps.figures(record))
            if done % config.checkpoint.every_steps == 0 or done == total:
                extra = {"step": done, "seed": config.seed, CHECKPOINT_KEY: steps.counters()}
                with deferred_interrupts():  # a save is never cut
                    model.save_checkpoint(done, extra)


def _samples(steps: Steps) -> list[dict[str, Any]]:
    """What a step's validation sampled, for ``samples.jsonl`` (PPO's ``take_samples``;
    none from Steps without one)."""
    take = getattr(steps, "take_samples", None)
    return [] if take is None else take()
