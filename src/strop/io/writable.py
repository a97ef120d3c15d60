"""Write targets checked before any work: a directory strop will write into must exist or
be creatable, and take a new file. A command refuses an unwritable one in one line
(:class:`~strop.errors.ConfigError`, exit 2) before it loads anything, rather than with
an ``OSError`` traceback once the work is done (an export after the model was built, a
plot, eval results, the first checkpoint, W&B's files)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from strop.errors import ConfigError, OutputExistsError


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


def require_output_dir(path: str | os.PathLike, what: str) -> Path:
    """Check the directory ``path`` that a command creates (an export's ``--out``): it must
    be new (its parent able to take it) or an existing *empty* directory strop can write
    in, which is written into, not replaced (:func:`strop.io.atomic.atomic_directory`: a
    container's output volume is such a directory, and a mount point cannot be renamed)."""
    path = Path(path)
    if path.is_dir():
        refuse_non_empty(path, f"{what} {path}")
        _check(path, f"{what} {path}")
    elif path.exists() or path.is_symlink():
        raise ConfigError(
            f"{what} {path}: is a file, not a directory; choose another path or move the file"
        )
    else:
        _check(path.absolute().parent, f"{what} {path}")
    return path


def refuse_non_empty(directory: Path, named: str) -> None:
    """Raise :class:`OutputExistsError` if ``directory`` holds anything (``named`` starts
    the message: the setting and the path)."""
    if any(directory.iterdir()):
        raise OutputExistsError(
            f"{named}: already exists and is not empty; choose a new or empty directory"
        )


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
