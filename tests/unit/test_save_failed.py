"""The one line a failed checkpoint save gives (:func:`strop.io.checkpoint_dir.save_failed`):
what failed, which checkpoint is intact (or that none was written yet), and the free
space where the save went, readable on a nearly full disk."""

from __future__ import annotations

import re

from strop.io.checkpoint_dir import save_failed
from tests.mounts import tmpfs

NO_SPACE = "OSError: [Errno 28] No space left on device"


def test_a_first_save_that_fails_says_none_was_written_and_the_free_kib(tmp_path):
    """Before: "the previous checkpoint (None) is intact ... (0 MiB free there)"."""
    with tmpfs(tmp_path / "disk", "600k") as disk:
        (disk / "filler").write_bytes(b"\0" * 300 * 1024)
        message = str(save_failed(1, disk, NO_SPACE, None))
    assert "(None)" not in message
    assert message.startswith(
        f"saving checkpoint step 1 to {disk} failed: {NO_SPACE}; no checkpoint was written "
        "yet. Check free space ("
    )
    free = int(re.search(r"\((\d+) KiB free there\)", message)[1])
    assert 200 <= free <= 300


def test_a_later_save_names_the_intact_checkpoint_and_free_mib(tmp_path):
    message = str(save_failed(4, tmp_path, NO_SPACE, 2))
    assert "; the previous checkpoint (2) is intact. Check free space (" in message
    assert re.search(r"\(\d+ MiB free there\)", message)  # the test machine's disk: > 10 MiB
