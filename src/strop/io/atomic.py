"""Outputs that appear only when complete (a staging directory, then a rename), written by
one process of several."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from strop.errors import StropError
from strop.io.writable import refuse_non_empty, writing


@contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory; on success its contents become ``target``.

    ``target`` may be new, an existing empty directory, or (with ``overwrite``) an existing
    directory to replace; anything else is refused (:class:`OutputExistsError`).

    If the body raises, the staging directory is removed and ``target`` is untouched.

    - A new ``target``: the staging directory is its sibling, renamed into place.
    - An existing empty directory is kept and filled, never renamed (it may be a mount
      point, a container's output volume, which cannot be): the staging directory is
      inside it, its entries are moved up once complete (renames within one filesystem,
      one per entry: a kill between two of them leaves part of the output there).
    - With ``overwrite`` an existing ``target`` is moved aside before the rename and
      deleted after it, so at every moment the old or the new complete directory is there.
    """
    target = Path(target)
    empty = target.is_dir() and not any(target.iterdir())
    if target.exists() and not empty and not overwrite:
        refuse_non_empty(target, str(target))
    if empty:
        with _filled_in_place(target) as staging:
            yield staging
        return
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


@contextmanager
def _filled_in_place(target: Path) -> Iterator[Path]:
    """A staging directory inside the empty directory ``target``, whose entries become
    ``target``'s once the body succeeds; on failure ``target`` is left empty."""
    staging = Path(tempfile.mkdtemp(prefix=".strop-staging-", dir=target))
    try:
        yield staging
        for entry in list(staging.iterdir()):
            os.replace(entry, target / entry.name)
        staging.rmdir()
    except BaseException:
        for entry in target.iterdir():  # staging, and what was moved up before the failure
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        raise


def write_text_atomically(path: str | os.PathLike, text: str, *, what: str = "") -> None:
    """Write ``text`` to ``path`` through a staging file renamed into place; a failure is
    one :class:`~strop.errors.WriteError` line naming ``what`` (default: the file's name)."""
    write_bytes_atomically(path, text.encode("utf-8"), what=what)


def write_bytes_atomically(path: str | os.PathLike, data: bytes, *, what: str = "") -> None:
    """The same for ``data``."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp")
    with writing(what or path.name, path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging.write_bytes(data)
            os.replace(staging, path)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise


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
