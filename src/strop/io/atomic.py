"""Outputs that appear only when complete: write into a staging directory, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; on success it becomes ``target``.

    If the body raises, the staging directory is removed and ``target`` is untouched. An
    existing ``target`` is moved aside before the rename and deleted after it, so at every
    moment either the old or the new complete directory is in place.
    """
    target = Path(target)
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
