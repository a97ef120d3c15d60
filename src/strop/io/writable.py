"""Write targets: checked before any work, and their failures while writing.

A directory strop will write into must exist or be creatable, and take a new file. A
command refuses an unwritable one in one line (:class:`~strop.errors.ConfigError`, exit
2) before it loads anything, rather than with an ``OSError`` traceback once the work is
done (an export after the model was built, a plot, eval results, the first checkpoint,
W&B's files).

A write can still fail later (the disk fills up during a run): :func:`writing` turns the
failure into one :class:`~strop.errors.WriteError` line naming what was being written,
where, and the free space there (:func:`free_space`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from strop.errors import ConfigError, OutputExistsError, WriteError

# What a failed write raises: the OS's errors, and safetensors' own type for them.
WRITE_FAILURES = (OSError, SafetensorError)


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


@contextmanager
def writing(what: str, path: str | os.PathLike) -> Iterator[None]:
    """Turn a write that fails in the body into one :class:`WriteError` line:
    ``writing <what> to <path> failed: <the OS's reason>; check the free space (N KiB free
    there) and permissions``."""
    try:
        yield
    except WRITE_FAILURES as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise WriteError(
            f"writing {what} to {path} failed: {reason}; check the free space"
            f"{free_space(path)} and permissions there"
        ) from err


def free_space(path: str | os.PathLike) -> str:
    """`` (N MiB free there)`` for the filesystem of ``path`` (or of its nearest existing
    parent), in KiB under 10 MiB (a full disk's few hundred KiB are not "0 MiB");
    nothing when it cannot be read."""
    for candidate in (Path(path), *Path(path).absolute().parents):
        try:
            stat = os.statvfs(candidate)
        except OSError:
            continue
        free = stat.f_bavail * stat.f_frsize
        if free < 10 * 2**20:
            return f" ({free / 2**10:.0f} KiB free there)"
        return f" ({free / 2**20:.0f} MiB free there)"
    return ""
