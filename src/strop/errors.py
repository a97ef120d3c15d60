"""Errors a user can cause, each with a message that says what to do.

The CLI catches :class:`StropError`, prints its message on one line and exits with
``exit_code``; anything else is a bug in strop and keeps its traceback.

Exit codes: 2 for every mistake in input (config, paths, data, checkpoints, options);
3 for :class:`NonFiniteError`, a run stopped because a loss or gradient went NaN/Inf.
"""

from __future__ import annotations


class StropError(Exception):
    """Base class for mistakes in user input: configs, paths, data, checkpoints, options."""

    exit_code: int = 2


class ConfigError(StropError):
    """A recipe, an override or a combination of options is invalid."""


class ModelError(StropError):
    """A model directory is missing, unsupported, or its weights do not fit its config."""


class CheckpointError(StropError):
    """A checkpoint cannot be read, written, or does not belong to this run."""


class DataError(StropError):
    """A data file is missing or malformed."""


class OutputExistsError(StropError):
    """An output directory already holds something strop was not asked to replace."""


class WriteError(StropError):
    """A file strop writes (metrics, TensorBoard, W&B's files, samples, an export, a plot,
    the run record) could not be written: a full disk, a vanished or read-only directory.
    The message names what was being written, where, and the free space there."""


class BackendUnavailableError(StropError):
    """The requested backend's packages are not installed."""


class NonFiniteError(StropError):
    """An optimizer step's loss or gradient norm was NaN/Inf and ``train.skip_nonfinite``
    is off. The step was not applied and nothing was saved after it; the message names the
    step (``where``), the values, the last complete checkpoint, which is kept, and the
    ``causes`` the loop saw (a huge reward or coefficient), else the usual advice."""

    exit_code = 3

    def __init__(
        self,
        where: str,
        values: dict[str, float],
        kept_step: int | None,
        checkpoint_dir: str | None = None,
        causes: tuple[str, ...] | list[str] = (),
    ):
        self.where, self.values, self.kept_step = where, dict(values), kept_step
        shown = " ".join(f"{name}={value:.6g}" for name, value in values.items())
        kept = "none yet" if kept_step is None else f"step {kept_step}"
        in_dir = f" in {checkpoint_dir}" if checkpoint_dir else ""
        advice = (
            f"likely cause: {'; '.join(causes)}"
            if causes
            else "fix the data or lower the learning rate"
        )
        super().__init__(
            f"{where}: non-finite {shown}; the update was not applied and no checkpoint was "
            f"written after it (last complete checkpoint: {kept}{in_dir}, kept); {advice}, "
            "or set train.skip_nonfinite=true to skip such steps"
        )


class NonFiniteStateError(StropError):
    """Trainable weights or optimizer state held NaN/Inf when a checkpoint was due (an
    update with a finite loss and gradient norm can still overflow a weight). The
    checkpoint is not written; the last complete one is kept. Exit code 3, as for a
    non-finite step."""

    exit_code = 3

    def __init__(self, step: int, names: list[str], kept_step: int | None, checkpoint_dir: str):
        self.step, self.names, self.kept_step = step, list(names), kept_step
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        kept = "none yet" if kept_step is None else f"step {kept_step}"
        super().__init__(
            f"checkpoint step {step}: non-finite values in {shown}; this state was not saved "
            f"(last complete checkpoint: {kept} in {checkpoint_dir}, kept); lower the learning "
            "rate or fix the data, then resume"
        )


class RunDirInUseError(StropError):
    """Another strop job holds the run directory's lock (:mod:`strop.io.run_lock`)."""
