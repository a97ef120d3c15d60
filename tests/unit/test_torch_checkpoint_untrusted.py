"""Torch training checkpoints (DCP) are read without unrestricted unpickling.

DCP itself unpickles ``.metadata`` with ``pickle.load`` and reads non-tensor entries with
``torch.load(weights_only=False)``; strop's reader and planner must refuse anything but
DCP's own metadata classes and plain values, and still restore real checkpoints exactly.
"""

from __future__ import annotations

import io
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from strop.backends.torch.checkpoint import TrainCheckpoints, _SafeLoadPlanner
from strop.backends.torch.fsdp import Placement
from strop.errors import CheckpointError, NonFiniteStateError


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def saved(tmp_path) -> TrainCheckpoints:
    checkpoints = TrainCheckpoints(tmp_path, {"run": 1}, Placement(torch.device("cpu")))
    model, optimizer = trained(0)
    checkpoints.save(1, model, optimizer, {"step": 1})
    return checkpoints


def test_real_checkpoint_restores_exactly(tmp_path):
    checkpoints = saved(tmp_path)
    reference, _ = trained(0)
    model, optimizer = trained(1)
    assert checkpoints.restore(1, model, optimizer) == {"step": 1}
    torch.testing.assert_close(model.weight, reference.weight, rtol=0, atol=0)
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)  # a non-tensor (bytes) entry
    assert checkpoints.stored_params(1) == ["bias", "weight"]


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_crafted_metadata_pickle_is_refused_without_running(tmp_path, monkeypatch):
    checkpoints = saved(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "1" / "state" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    (tmp_path / "1" / "checksums.json").unlink()  # a crafted step would match its own
    model, optimizer = trained(1)
    with pytest.raises(CheckpointError, match=r"metadata names (posix|os)\.system, refused"):
        checkpoints.restore(1, model, optimizer)
    with pytest.raises(CheckpointError, match="refused"):
        checkpoints.stored_params(1)
    assert not (tmp_path / "pwned").exists()


def test_non_tensor_entries_are_loaded_weights_only():
    planner = _SafeLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    buffer = io.BytesIO()
    torch.save(0.5, buffer)
    buffer.seek(0)
    planner.load_bytes(item, buffer)
    assert planner.state_dict["optim.param_groups.0.lr"] == 0.5
    buffer = io.BytesIO()
    torch.save(_RunsCode(), buffer)  # pickles os.system
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buffer)


def test_non_finite_state_is_never_saved(tmp_path):
    """A weight (or optimizer moment) gone NaN/Inf after a finite step: the checkpoint is
    refused with NonFiniteStateError (exit 3) and the last complete one kept."""
    checkpoints = saved(tmp_path)
    model, optimizer = trained(0)
    with torch.no_grad():
        model.weight[0, 1] = float("inf")
    with pytest.raises(NonFiniteStateError, match=r"checkpoint step 2: non-finite values in "
                       r"model\.weight; this state was not saved \(last complete checkpoint: "
                       r"step 1"):  # fmt: skip
        checkpoints.save(2, model, optimizer, {"step": 2})
    assert checkpoints.all_steps() == [1] and not list(tmp_path.glob(".tmp-*"))
    model, optimizer = trained(0)
    optimizer.state[model.bias]["exp_avg_sq"][0] = float("nan")
    with pytest.raises(NonFiniteStateError, match=r"optim\.state\.bias\.exp_avg_sq"):
        checkpoints.save(2, model, optimizer, {"step": 2})
    assert NonFiniteStateError.exit_code == 3


def test_damaged_checkpoints_are_one_line_naming_the_intact_step(tmp_path):
    """Each file's sha256 is stored with the step and verified before DCP reads a tensor:
    values changed in place (the weight x50, same size) and a truncated shard are refused
    naming the intact step; a step without checksums (older strop) still restores; DCP's
    own error (a traceback per rank) is one short line."""
    checkpoints = saved(tmp_path)
    model, optimizer = trained(0)
    checkpoints.save(2, model, optimizer, {"step": 2})
    shard = tmp_path / "2" / "state" / "__0_0.distcp"
    data = shard.read_bytes()
    weight = model.weight.detach().numpy().tobytes()
    assert data.count(weight) == 1
    shard.write_bytes(data.replace(weight, (model.weight.detach() * 50).numpy().tobytes()))
    with pytest.raises(CheckpointError) as caught:
        checkpoints.restore(2, *trained(1))
    assert str(caught.value) == (
        f"checkpoint step 2 in {tmp_path} is damaged (state/__0_0.distcp differs from what "
        f"was written (sha256 mismatch)); step 1 is intact: delete {tmp_path / '2'} to resume "
        "from step 1"
    )
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"step 2 .* damaged \(state/__0_0.distcp has \d+ "
                       r"bytes, \d+ were written\); step 1 is intact"):  # fmt: skip
        checkpoints.restore(2, *trained(1))

    (tmp_path / "2" / "checksums.json").unlink()  # as strop wrote steps before checksums
    with pytest.raises(CheckpointError) as caught:
        checkpoints.restore(2, *trained(1))
    line = str(caught.value)
    assert line.startswith(f"cannot restore checkpoint {tmp_path / '2'}: rank 0: ")
    assert "\n" not in line and len(line) < 300 + len(str(tmp_path)), line
    (tmp_path / "1" / "checksums.json").unlink()
    reference, _ = trained(0)
    model, optimizer = trained(1)
    assert checkpoints.restore(1, model, optimizer) == {"step": 1}
    torch.testing.assert_close(model.weight, reference.weight, rtol=0, atol=0)
