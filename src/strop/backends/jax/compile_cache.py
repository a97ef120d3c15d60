"""JAX's persistent compilation cache, on by default: a second run (and every process of
the test suite after the first) loads compiled programs instead of compiling them again.

Where: ``$STROP_JAX_CACHE`` if set (``off`` turns the cache off), else
``$XDG_CACHE_HOME/strop/jax`` (``~/.cache/strop/jax``). A ``JAX_COMPILATION_CACHE_DIR``
the user set wins: JAX reads it itself and strop leaves it alone. Every program is cached
whatever its compile time (a tiny model's programs compile in well under JAX's default
1 s threshold, yet a PPO iteration has dozens of them), unless
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise; the least recently used
programs are dropped beyond 2 GiB (``JAX_COMPILATION_CACHE_MAX_SIZE``). A cache directory that
cannot be created leaves the cache off, with a debug log line; compiling still works.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

OFF = ("0", "off", "false", "no", "none")
MAX_BYTES = 2 << 30


def cache_directory() -> Path | None:
    """Where strop keeps JAX's compiled programs, or ``None`` when it should not."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None  # the user's own choice; JAX applies it
    setting = os.environ.get("STROP_JAX_CACHE", "").strip()
    if setting.lower() in OFF and setting:
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "strop" / "jax"


def enable_compilation_cache() -> None:
    """Point JAX's persistent compilation cache at :func:`cache_directory`."""
    directory = cache_directory()
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        logger.debug("JAX compilation cache off: cannot create %s (%s)", directory, err)
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
