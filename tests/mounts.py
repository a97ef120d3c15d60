"""Small real filesystems for tests: a tmpfs mounted on a directory, as a container's
output volume is (a mount point cannot be renamed or replaced), a full disk (writes past
its size fail with ENOSPC) or a read-only volume (EROFS, even for root).

Mounting needs CAP_SYS_ADMIN (CI runs as root); where it is not permitted the test is
skipped with the reason, never failed.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def tmpfs(directory: Path, size: str = "1m", *, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``: "600k", "1m") mounted on ``directory``
    (made if missing), unmounted afterwards."""
    directory.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "--lazy", str(directory)], check=False)
