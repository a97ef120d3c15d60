"""Checksums of a checkpoint step's files, and the one line a damaged step gives."""

from __future__ import annotations

import pytest

from strop.errors import CheckpointError
from strop.io.checkpoint_dir import require_intact, short_reason
from strop.io.checksums import MANIFEST, checksum_problem, write_checksums


def step(directory, number: int, skip=()):
    path = directory / str(number)
    (path / "state").mkdir(parents=True)
    (path / "state" / "shard").write_bytes(bytes(range(256)) * 4)
    (path / "identity.json").write_text("{}")
    (path / "rewritten").write_text("later")
    write_checksums(path, skip)
    return path


def flip(path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_intact_damaged_and_legacy_steps(tmp_path):
    path = step(tmp_path, 1, skip=["rewritten"])
    (path / "rewritten").write_text("rewritten after the checksums")  # skipped: not judged
    assert checksum_problem(path) is None
    flip(path / "state" / "shard")
    assert checksum_problem(path) == "state/shard differs from what was written (sha256 mismatch)"
    (path / "state" / "shard").write_bytes(b"cut")
    assert checksum_problem(path) == "state/shard has 3 bytes, 1024 were written"
    (path / "state" / "shard").unlink()
    assert checksum_problem(path) == "state/shard is missing"
    (path / MANIFEST).write_text('{"files": [')
    assert checksum_problem(path) == f"{MANIFEST} is not the JSON strop wrote"
    (path / MANIFEST).unlink()  # a step written before checksums existed: not checked
    assert checksum_problem(path) is None


def test_a_damaged_step_names_the_newest_intact_one(tmp_path):
    for number in (1, 2, 3, 4):
        step(tmp_path, number)
    require_intact(4, tmp_path, [1, 2, 3, 4])
    (tmp_path / "4" / "state" / "shard").write_bytes(b"cut")
    with pytest.raises(CheckpointError) as caught:
        require_intact(4, tmp_path, [1, 2, 3, 4])
    assert str(caught.value) == (
        f"checkpoint step 4 in {tmp_path} is damaged (state/shard has 3 bytes, 1024 were "
        f"written); step 3 is intact: delete {tmp_path / '4'} to resume from step 3"
    )
    flip(tmp_path / "3" / "identity.json", at=0)
    with pytest.raises(CheckpointError, match=rf"step 2 is intact: delete steps 3, 4 in {tmp_path} "
                       "to resume from step 2$"):  # fmt: skip
        require_intact(4, tmp_path, [1, 2, 3, 4])
    for number in (1, 2):
        (tmp_path / str(number) / "identity.json").unlink()
    with pytest.raises(
        CheckpointError, match=rf"no earlier checkpoint is intact; delete {tmp_path}"
    ):
        require_intact(4, tmp_path, [1, 2, 3, 4])


def test_short_reason():
    assert short_reason("a\n  b") == "a b"
    long = short_reason("x " * 500)
    assert len(long) == 200 and long.endswith("...")
