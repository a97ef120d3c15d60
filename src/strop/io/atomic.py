"""Outputs that appear only when complete: write into a staging directory, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from strop.errors import OutputExistsError


@contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; on success it becomes ``target``.

    A non-empty ``target`` is refused unless ``overwrite`` is set.

    If the body raises, the staging directory is removed and ``target`` is untouched. An
    existing ``target`` is moved aside before the rename and deleted after it, so at every
    moment either the old or the new complete directory is in place.
    """
    target = Path(target)
    if target.exists() and not overwrite and not (target.is_dir() and not any(target.iterdir())):
        raise OutputExistsError(f"{target}: already exists; choose a new directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            old = staging.with_name(staging.name + ".old")
            os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
