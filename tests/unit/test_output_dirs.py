"""Output directories strop creates (exports, adapters, merged models, data splits): they
appear only when complete, may be an existing empty directory (a container's output
volume is a mount point, which cannot be renamed or replaced), and ``strop export``
refuses an ``--out`` it cannot use before it restores anything."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest

from strop.config import load_config
from strop.errors import ConfigError, OutputExistsError
from strop.io.atomic import atomic_directory
from tests.mounts import tmpfs


def write_two_files(target, *, fail: bool = False):
    with atomic_directory(target) as staging:
        (staging / "a.json").write_text("{}")
        (staging / "sub").mkdir()
        (staging / "sub" / "b.bin").write_bytes(b"x" * 10)
        if fail:
            raise RuntimeError("the writer failed half-way")


@pytest.mark.parametrize("kind", ["new", "empty directory", "empty mount point"])
def test_an_output_appears_complete_in_a_new_or_empty_directory(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "empty directory":
        target.mkdir()
    with tmpfs(target) if kind == "empty mount point" else nullcontext():
        with pytest.raises(RuntimeError, match="half-way"):
            write_two_files(target, fail=True)
        assert not target.exists() or list(target.iterdir()) == []  # nothing half-written
        write_two_files(target)  # before: OSError EBUSY renaming the mount point itself
        assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*")) == [
            "a.json", "sub", "sub/b.bin",
        ]  # fmt: skip
        assert os.path.ismount(target) == (kind == "empty mount point")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left
        with pytest.raises(OutputExistsError, match="already exists and is not empty"):
            write_two_files(target)


@pytest.fixture
def nothing_to_export(tmp_path):
    """A config whose run has no checkpoint: an ``--out`` refused later than first would
    be refused for that instead ("no torch checkpoint in ...")."""
    return load_config("tiny", [f"run_dir={tmp_path / 'run'}", "backend=torch"])


def test_export_refuses_a_non_empty_out_before_anything(nothing_to_export, tmp_path):
    from strop.commands.export import run_export

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=rf"^--out {out}: already exists and is not empty"):
        run_export(nothing_to_export, out, merged=False)
    assert (out / "notes.txt").read_text() == "mine"


def test_export_refuses_a_read_only_mount_point_before_anything(nothing_to_export, tmp_path):
    """Before: the parent's writability was checked, so a read-only volume passed and
    the export failed after the restore."""
    from strop.commands.export import run_export

    out = tmp_path / "ro"
    refusal = rf"^--out {out}: cannot write in {out}: Read-only file system"
    with tmpfs(out, read_only=True), pytest.raises(ConfigError, match=refusal):
        run_export(nothing_to_export, out, merged=True)
