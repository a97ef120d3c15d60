"""Outputs that appear only when complete (a staging directory, then a rename), written by
one process of several."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from strop.errors import OutputExistsError, StropError


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


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a staging file renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def write_on_one_process(
    write: Callable[[], object], what: str, *, is_main: bool, share: Callable[[str], str]
) -> None:
    """Run ``write`` in the main process only; every process returns once it has ended.

    ``what`` says what it does, for the other processes' error: "writing the adapter X".

    For a file a run of several processes writes (an export, a plot, data splits): one
    process writes it, and none goes on before it exists. ``share(text)`` is the backend's
    broadcast from the main process (a collective: every process calls it once); it carries
    the outcome, so a failed write raises in every process, not only in the main one,
    whose original error propagates. Collectives the write needs (gathering sharded
    weights) are the caller's, in every process.
    """
    failure: Exception | None = None
    if is_main:
        try:
            write()
        except Exception as err:  # shared first, then raised: the others must not wait forever
            failure = err
    message = share("" if failure is None else " ".join(str(failure).split()) or repr(failure))
    if failure is not None:
        raise failure
    if message:
        raise StropError(f"the main process failed {what}: {message}")
