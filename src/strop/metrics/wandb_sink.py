"""Weights & Biases as a third metrics sink (``logging.wandb=true``), next to
``metrics.jsonl`` and TensorBoard.

The W&B run is named after the run directory, carries the resolved config, and receives
the same records at the same steps. Its id is kept in ``<run_dir>/wandb-run-id``, so a
resumed strop run continues the same W&B run (W&B keeps the first value logged at a step:
steps a killed attempt logged past its checkpoint are not replaced there, unlike in
``metrics.jsonl``). ``WANDB_MODE=offline`` writes the run under ``<run_dir>/wandb`` without
a network, to be synced later with ``wandb sync``.

``wandb`` is an optional extra: :func:`require_wandb` refuses ``logging.wandb=true``
without it before anything loads, and :func:`require_wandb_login` an online run with no
W&B credentials (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE`` or a ``wandb login``
entry in ``~/.netrc``), which ``wandb.init`` would otherwise refuse with a traceback once
the models are built.
"""

from __future__ import annotations

import configparser
import importlib.util
import logging
import netrc
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from strop.errors import ConfigError
from strop.io.atomic import write_text_atomically
from strop.io.writable import writing

INSTALL = "pip install 'strop[wandb]'"
RUN_ID_FILE = "wandb-run-id"


def require_wandb() -> None:
    """Raise :class:`ConfigError` with the install line when ``wandb`` is not installed."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"logging.wandb=true needs the wandb package, which is not installed: {INSTALL} "
            "(or set logging.wandb=false)"
        )


OFFLINE_MODES = ("offline", "dryrun", "disabled")


def require_wandb_login() -> None:
    """Raise :class:`ConfigError` when an online W&B run would find no credentials:
    neither ``WANDB_MODE`` (or a ``wandb offline`` setting) offline, nor
    ``WANDB_API_KEY`` / ``WANDB_IDENTITY_TOKEN_FILE``, nor the W&B host in the netrc file
    (``$NETRC``, else ``~/.netrc``) where ``wandb login`` keeps the key."""
    if _wandb_mode() in OFFLINE_MODES or os.environ.get("WANDB_DISABLED", "").lower() in (
        "true", "1",
    ):  # fmt: skip
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        if (netrc.netrc(path).authenticators(host) or (None, None, None))[2]:
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ConfigError(
        f"logging.wandb=true, but no W&B login was found (no WANDB_API_KEY, no {host} "
        f"entry in {path}): run `wandb login` or set WANDB_API_KEY; or set "
        "WANDB_MODE=offline to keep the W&B run under run_dir/wandb and sync it later; "
        "or logging.wandb=false"
    )


def _wandb_mode() -> str:
    """``WANDB_MODE``, else the ``mode`` a ``wandb offline`` / ``wandb online`` wrote to
    W&B's settings files (the working directory's, then the user's)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"].lower()
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb"
    for settings in (Path("wandb") / "settings", Path(config_dir) / "settings"):
        parser = configparser.ConfigParser()
        try:
            parser.read(settings)
        except (OSError, configparser.Error):
            continue
        if parser.has_option("default", "mode"):
            return parser.get("default", "mode").lower()
    return "online"


class WandbSink:
    """One W&B run for one strop run directory."""

    def __init__(self, run_dir: str | Path, project: str, config: Mapping[str, Any]):
        require_wandb()
        import wandb

        run_dir = Path(run_dir).absolute()
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            write_text_atomically(id_file, run_id + "\n")
        self.files = run_dir / "wandb"
        with self._writing():
            self._run = wandb.init(
                project=project,
                name=run_dir.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=dict(config),
            )

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        with self._writing():
            self._run.log(numbers, step=step)

    def write_table(self, step: int, tag: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """``rows`` (records of the same keys) as a W&B table ``tag`` at ``step``."""
        import wandb

        columns = list(rows[0])
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        with self._writing():
            self._run.log({tag: wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        with self._writing():
            self._run.finish()

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A call into W&B: a failed write of its run files (``<run_dir>/wandb``) is one
        :class:`~strop.errors.WriteError` line. W&B's debug log under that directory is a
        ``logging`` file handler, which on a full disk printed a "--- Logging error ---"
        traceback per record (thousands of lines); ``logging.raiseExceptions`` is off for
        the call, so those are dropped (the failure surfaces, at the latest, from
        ``finish``)."""
        previous, logging.raiseExceptions = logging.raiseExceptions, False
        try:
            with writing("W&B's run files", self.files):
                yield
        finally:
            logging.raiseExceptions = previous


def _cell(value: Any) -> Any:
    """A table cell: numbers as they are, anything else as text (None as "")."""
    if isinstance(value, int | float):
        return value
    return "" if value is None else str(value)
