"""Checksums of a checkpoint step's files, written with the step and verified on restore.

A step directory's files are final once the backend has written them (and before the
rename that makes the step visible); :func:`write_checksums` records each file's size and
sha256 in ``checksums.json`` inside the step, and :func:`checksum_problem` compares them
before a restore reads anything, so a file truncated or altered later (a disk fault, a
copy cut short, a hand edit) is named instead of being loaded or half-read. sha256 reads
about 1 GB/s on one core, once per save and once per restore.

Steps written before checksums existed have no ``checksums.json`` and are not checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "checksums.json"
_ALGORITHM = "sha256"


def _files(step_dir: Path, skip: Collection[str]) -> list[str]:
    """Paths (relative, POSIX) of the files under ``step_dir`` but the manifest and
    ``skip`` (files the backend still rewrites after the manifest, relative paths)."""
    found = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            relative = (Path(root) / name).relative_to(step_dir).as_posix()
            if relative != MANIFEST and relative not in skip:
                found.append(relative)
    return sorted(found)


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, _ALGORITHM).hexdigest()


def write_checksums(step_dir: str | os.PathLike, skip: Collection[str] = ()) -> None:
    """Record the size and sha256 of every file under ``step_dir`` (but ``skip``) in its
    ``checksums.json``, flushed to disk. Call once the files are final, before the step
    becomes visible, in one process."""
    step_dir = Path(step_dir)
    files = {
        name: {"size": (step_dir / name).stat().st_size, _ALGORITHM: _digest(step_dir / name)}
        for name in _files(step_dir, skip)
    }
    with (step_dir / MANIFEST).open("w") as f:
        json.dump({"algorithm": _ALGORITHM, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def checksum_problem(step_dir: str | os.PathLike) -> str | None:
    """What is wrong with ``step_dir``'s files (a short phrase naming the first damaged
    file), or ``None`` when they match ``checksums.json`` or there is none (a step written
    before checksums existed). Files not in the manifest are not judged."""
    step_dir = Path(step_dir)
    try:
        text = (step_dir / MANIFEST).read_text()
    except FileNotFoundError:
        logger.debug("%s has no %s (written before checksums): not verified", step_dir, MANIFEST)
        return None
    except OSError as err:
        return f"{MANIFEST} is unreadable: {err.strerror or err}"
    try:
        files = json.loads(text)["files"]
        expected = {str(name): (int(e["size"]), str(e[_ALGORITHM])) for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is not the JSON strop wrote"
    for name, (size, digest) in sorted(expected.items()):
        path = step_dir / name
        try:
            actual = path.stat().st_size
            if actual != size:
                return f"{name} has {actual} bytes, {size} were written"
            if _digest(path) != digest:
                return f"{name} differs from what was written ({_ALGORITHM} mismatch)"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as err:
            return f"{name} is unreadable: {err.strerror or err}"
    return None
