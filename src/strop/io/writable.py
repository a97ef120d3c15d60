"""Write targets checked before any work: a directory strop will write into must exist or
be creatable, and take a new file. A command refuses an unwritable one in one line
(:class:`~strop.errors.ConfigError`, exit 2) before it loads anything, rather than with
an ``OSError`` traceback once the work is done (an export after the model was built, a
plot, eval results, the first checkpoint, W&B's files)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from strop.errors import ConfigError


def require_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Create the directory ``path`` (and its parents) if it is missing and check that a
    file can be created in it; return it. ``what`` names the setting in the error
    (``run_dir``, ``checkpoint.dir``)."""
    _check(Path(path), f"{what}={path}")
    return Path(path)


def require_writable_parent(path: str | os.PathLike, what: str) -> Path:
    """The same for the directory a file or directory ``path`` is created in (strop
    writes through a staging entry beside it, renamed into place)."""
    _check(Path(path).absolute().parent, f"{what} {path}")
    return Path(path)


def _check(directory: Path, named: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".strop-write-check-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except (FileExistsError, NotADirectoryError):  # a file where a directory goes
        raise ConfigError(
            f"{named}: {_file_in_the_way(directory)} is a file, not a directory; choose "
            "another path or move the file"
        ) from None
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(
            f"{named}: cannot write in {directory}: {reason}; choose a writable directory"
        ) from None


def _file_in_the_way(directory: Path) -> Path:
    """The nearest of ``directory`` and its parents that exists and is not a directory."""
    for candidate in (directory, *directory.parents):
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return directory
