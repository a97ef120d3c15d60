"""Errors a user can cause, each with a message that says what to do.

The CLI catches :class:`StropError`, prints its message on one line and exits with
``exit_code``; anything else is a bug in strop and keeps its traceback.
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


class BackendUnavailableError(StropError):
    """The requested backend's packages are not installed."""
