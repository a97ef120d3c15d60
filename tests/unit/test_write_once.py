"""One process of several writes each output; the others wait for it and share its outcome.

The two-process runs (``tests/distributed``) show it end to end; here the logic of
:func:`write_on_one_process` and :func:`write_checkpoint_once` with a stand-in for the
backend's broadcast.
"""

from __future__ import annotations

import numpy as np
import pytest

from strop.errors import OutputExistsError, StropError
from strop.io.atomic import write_on_one_process
from strop.io.hf import write_checkpoint_once
from tests.tiny_models import QWEN25_CONFIG


class Broadcast:
    """Stands in for the backend's broadcast: records what this process sent, returns
    what the main process sent (``from_main``, or this process's own text)."""

    def __init__(self, from_main: str | None = None):
        self.sent: list[str] = []
        self.from_main = from_main

    def __call__(self, text: str) -> str:
        self.sent.append(text)
        return text if self.from_main is None else self.from_main


def test_the_main_process_writes_and_shares_success():
    calls, share = [], Broadcast()
    write_on_one_process(lambda: calls.append("w"), "x", is_main=True, share=share)
    assert calls == ["w"] and share.sent == [""]


def test_another_process_does_not_write_and_waits_for_the_outcome():
    calls, share = [], Broadcast(from_main="")
    write_on_one_process(lambda: calls.append("w"), "x", is_main=False, share=share)
    assert calls == [] and share.sent == [""]


def test_a_failed_write_raises_in_the_main_process_after_sharing_it():
    def write():
        raise OutputExistsError("runs/a/adapter: already exists;\n choose a new directory")

    share = Broadcast()
    with pytest.raises(OutputExistsError, match="already exists"):
        write_on_one_process(write, "the adapter", is_main=True, share=share)
    assert share.sent == ["runs/a/adapter: already exists; choose a new directory"]


def test_a_failed_write_raises_in_every_other_process_with_its_message():
    share = Broadcast(from_main="[Errno 28] No space left on device")
    with pytest.raises(StropError) as caught:
        write_on_one_process(
            lambda: None, "writing the adapter runs/a/adapter", is_main=False, share=share
        )
    assert str(caught.value) == (
        "the main process failed writing the adapter runs/a/adapter: "
        "[Errno 28] No space left on device"
    )


def _tensors(gathered: list[str]):
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        gathered.append(name)  # stands for a gather every process takes part in
        yield name, np.zeros((2, 2), np.float32)


def _write(path, gathered, *, is_main, share):
    def write_once(write, what):
        write_on_one_process(write, what, is_main=is_main, share=share)

    return write_checkpoint_once(
        path, QWEN25_CONFIG, _tensors(gathered), is_main=is_main, write_once=write_once,
        dtype_name="float32",
    )  # fmt: skip


def test_every_process_gathers_every_tensor_and_only_the_main_one_writes(tmp_path):
    gathered: list[str] = []
    assert _write(tmp_path / "other", gathered, is_main=False, share=Broadcast("")) == (
        tmp_path / "other"
    )
    assert len(gathered) == 2 and not (tmp_path / "other").exists()

    gathered = []
    _write(tmp_path / "main", gathered, is_main=True, share=Broadcast())
    assert len(gathered) == 2 and (tmp_path / "main" / "model.safetensors").is_file()


def test_a_main_process_that_fails_still_gathers_to_the_end(tmp_path):
    """Otherwise the other processes would wait in a gather forever, never hearing of it."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    gathered: list[str] = []
    share = Broadcast()
    with pytest.raises(OutputExistsError):
        _write(tmp_path / "taken", gathered, is_main=True, share=share)
    assert len(gathered) == 2 and "already exists" in share.sent[0]


@pytest.mark.parametrize("text", ["", "disk full", "é" * 600])
def test_the_jax_broadcast_carries_text(text):
    from strop.backends.jax.sharding import _broadcast_text

    shared = _broadcast_text(text)
    assert shared == text.encode()[:1024].decode(errors="ignore")
