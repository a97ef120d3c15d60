"""The layout check: mesh sizes against the device count, rows per pass against the
data-parallel axes; from the config alone, before anything loads."""

from __future__ import annotations

import pytest

from strop.config import load_config
from strop.errors import ConfigError
from strop.preflight import check_parallel_layout, rows_per_pass


def config(recipe: str = "tiny", **overrides):
    return load_config(recipe, [f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.parametrize(
    ("devices", "mesh", "expected"),
    [
        (1, {}, {"data": 1, "fsdp": 1, "tensor": 1}),
        (8, {}, {"data": 1, "fsdp": 8, "tensor": 1}),
        (8, {"mesh.data": 2}, {"data": 2, "fsdp": 4, "tensor": 1}),
        (8, {"mesh.tensor": 2}, {"data": 1, "fsdp": 4, "tensor": 2}),
        (8, {"mesh.fsdp": 1, "mesh.tensor": -1}, {"data": 1, "fsdp": 1, "tensor": 8}),
    ],
)
def test_layouts_that_fit(devices, mesh, expected):
    assert check_parallel_layout(config(**mesh, **{"sft.micro_batch_size": 8}), devices) == (
        expected
    )
    layout = config(**mesh, **{"sft.batch_size": 16, "sft.micro_batch_size": 8})
    assert check_parallel_layout(layout, devices, rows_per_pass(layout, "sft")) == expected


@pytest.mark.parametrize(
    ("devices", "mesh"),
    [
        (8, {"mesh.data": 3}),  # 3 does not divide 8
        (8, {"mesh.fsdp": 2}),  # product 2 on 8 devices, no -1 axis
        (2, {"mesh.fsdp": 4}),  # more than there are
        (6, {"mesh.tensor": 4}),
    ],
)
def test_mesh_sizes_that_do_not_fit_the_devices(devices, mesh):
    with pytest.raises(ConfigError, match=rf"mesh sizes .* do not fit {devices} device\(s\)"):
        check_parallel_layout(config(**mesh), devices)


def test_rows_per_pass_must_split_over_data_times_fsdp():
    sft = config(**{"sft.batch_size": 12, "sft.micro_batch_size": 6, "mesh.data": 2})
    with pytest.raises(ConfigError) as err:
        check_parallel_layout(sft, 8, rows_per_pass(sft, "sft"))
    assert str(err.value) == (
        "sft.micro_batch_size=6 rows do not split over the 8 data-parallel devices (mesh "
        "data=2 x fsdp=4 on 8 device(s)): make sft.micro_batch_size a multiple of 8"
    )
    # tensor parallelism splits no rows: 6 rows over data 2 x fsdp 1 x tensor 4 fit
    fits = config(**{"sft.batch_size": 12, "sft.micro_batch_size": 6, "mesh.data": 2,
                     "mesh.fsdp": 1, "mesh.tensor": -1})  # fmt: skip
    assert check_parallel_layout(fits, 8, rows_per_pass(fits, "sft"))["tensor"] == 4


def test_ppo_rows_are_the_micro_batch_or_else_the_mini_batch():
    ppo = config("ppo-lora-tiny")
    assert ppo.ppo.micro_batch_size is None
    assert rows_per_pass(ppo, "ppo") == {"ppo.mini_batch_size": ppo.ppo.mini_batch_size}
    micro = config("ppo-lora-tiny", **{"ppo.micro_batch_size": 4})
    assert rows_per_pass(micro, "ppo") == {"ppo.micro_batch_size": 4}
    with pytest.raises(ConfigError, match=r"ppo\.micro_batch_size=4 rows do not split over the 8"):
        check_parallel_layout(micro, 8, rows_per_pass(micro, "ppo"))
    check_parallel_layout(micro, 4, rows_per_pass(micro, "ppo"))
    assert rows_per_pass(ppo, "eval") == {}


def _model_with_positions(tmp_path, positions: int) -> str:
    """A model directory whose config.json allows ``positions`` positions (all the
    context check reads)."""
    import json

    from strop.io.tiny import tiny_qwen2_config

    (tmp_path / "config.json").write_text(
        json.dumps({**tiny_qwen2_config(128), "max_position_embeddings": positions})
    )
    return str(tmp_path)


def test_context_longer_than_the_models_positions_is_refused_in_one_line(tmp_path):
    from strop.preflight import check_context_length

    path = _model_with_positions(tmp_path, 64)
    limit = f"the model's max_position_embeddings=64 ({path}/config.json)"
    sft = config(**{"model.path": path, "data.max_length": 65})
    with pytest.raises(ConfigError) as err:
        check_context_length(sft, "sft")
    assert str(err.value) == (
        f"data.max_length=65 is more than {limit}: lower data.max_length to at most 64"
    )
    check_context_length(config(**{"model.path": path, "data.max_length": 64}), "sft")

    ppo = config(**{"model.path": path, "generation.max_new_tokens": 64})
    for job in ("ppo", "eval"):  # at preflight: no room for any prompt
        with pytest.raises(ConfigError, match=r"generation\.max_new_tokens=64 leaves no room"):
            check_context_length(ppo, job)
    ppo = config(**{"model.path": path, "generation.max_new_tokens": 24})
    check_context_length(ppo, "ppo")  # the prompts are not read yet
    check_context_length(ppo, "ppo", 40)  # 40 + 24 = 64 fit
    with pytest.raises(ConfigError) as err:
        check_context_length(ppo, "ppo", 41)
    assert str(err.value) == (
        f"the longest prompt (41 tokens) + generation.max_new_tokens=24 is more than {limit}: "
        "lower generation.max_new_tokens to at most 23, or data.max_length to 40 to drop "
        "the longer prompts"
    )
    with pytest.raises(ConfigError, match=r"at most 23$"):  # eval drops no prompt
        check_context_length(ppo, "eval", 41)
