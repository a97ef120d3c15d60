"""The layout check: mesh sizes against the device count, rows per pass against the
data-parallel axes; from the config alone, before anything loads."""

from __future__ import annotations

import json

import pytest

from strop.config import load_config
from strop.errors import ConfigError
from strop.run.kinds import run_kind


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
    assert config(**mesh, **{"sft.micro_batch_size": 8}).mesh.check_layout(devices) == (expected)
    layout = config(**mesh, **{"sft.batch_size": 16, "sft.micro_batch_size": 8})
    assert layout.mesh.check_layout(devices, run_kind("sft").rows_per_pass(layout)) == expected


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
        config(**mesh).mesh.check_layout(devices)


def test_rows_per_pass_must_split_over_data_times_fsdp():
    sft = config(**{"sft.batch_size": 12, "sft.micro_batch_size": 6, "mesh.data": 2})
    with pytest.raises(ConfigError) as err:
        sft.mesh.check_layout(8, run_kind("sft").rows_per_pass(sft))
    assert str(err.value) == (
        "sft.micro_batch_size=6 rows do not split over the 8 data-parallel devices (mesh "
        "data=2 x fsdp=4 on 8 device(s)): make sft.micro_batch_size a multiple of 8"
    )
    # tensor parallelism splits no rows: 6 rows over data 2 x fsdp 1 x tensor 4 fit
    fits = config(**{"sft.batch_size": 12, "sft.micro_batch_size": 6, "mesh.data": 2,
                     "mesh.fsdp": 1, "mesh.tensor": -1})  # fmt: skip
    assert fits.mesh.check_layout(8, run_kind("sft").rows_per_pass(fits))["tensor"] == 4


def test_ppo_rows_are_the_micro_batch_or_else_the_mini_batch():
    ppo = config("ppo-lora-tiny")
    assert ppo.ppo.micro_batch_size is None
    assert run_kind("ppo").rows_per_pass(ppo) == {"ppo.mini_batch_size": ppo.ppo.mini_batch_size}
    micro = config("ppo-lora-tiny", **{"ppo.micro_batch_size": 4})
    assert run_kind("ppo").rows_per_pass(micro) == {"ppo.micro_batch_size": 4}
    with pytest.raises(ConfigError, match=r"ppo\.micro_batch_size=4 rows do not split over the 8"):
        micro.mesh.check_layout(8, run_kind("ppo").rows_per_pass(micro))
    micro.mesh.check_layout(4, run_kind("ppo").rows_per_pass(micro))
    assert run_kind("eval").rows_per_pass(ppo) == {}


# A resume the checkpoints refuse, and a run already past its end: refused here, before
# the tokenizer, the data or a model loads, and before config.yaml / versions.json change.


def _checkpointed_run(tmp_path, backend: str, job: str, step: int, *overrides: str):
    """A run directory as a finished ``job`` leaves it, without training: its record files
    and the identity of checkpoint ``step``, where ``backend`` stores it."""
    from strop.assets import tiny_math_path
    from strop.io.checkpoint_dir import IDENTITY_FILES
    from strop.io.run_identity import job_identity

    run_dir = tmp_path / "run"
    recipe = "ppo-lora-tiny" if job == "ppo" else "tiny"
    trained = load_config(
        recipe,
        [f"model.path={tiny_math_path()}", f"run_dir={run_dir}", f"backend={backend}",
         "data.train_path=train.jsonl", "data.eval_path=val.jsonl", "mesh.fsdp=1", "mesh.tensor=-1", *overrides],
    )  # fmt: skip
    identity = run_dir / "checkpoints" / str(step) / IDENTITY_FILES[backend]
    identity.parent.mkdir(parents=True)
    identity.write_text(
        json.dumps(
            job_identity(
                trained, backend, job=run_kind(job).identity_job, roles=run_kind(job).roles(trained)
            )
        )
    )
    (run_dir / "config.yaml").write_text("recorded: config\n")
    (run_dir / "versions.json").write_text('{"recorded": "versions"}')
    return trained, run_dir


def _records(run_dir) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in ("config.yaml", "versions.json")}


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_resume_of_another_run_is_refused_before_anything_loads(tmp_path, backend, capsys):
    from strop.cli import main

    trained, run_dir = _checkpointed_run(tmp_path, backend, "ppo", 2, "lora.rank=8")
    before = _records(run_dir)
    args = ["ppo", "ppo-lora-tiny", f"model.path={trained.model.path}", f"run_dir={run_dir}",
            f"backend={backend}", "lora.rank=4", f"data.train_path={tmp_path / 'absent.jsonl'}",
            "data.eval_path=val.jsonl",
            "mesh.fsdp=1", "mesh.tensor=-1"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()  # the identity, not the missing data
    assert "lora.rank is 8 in the checkpoint but 4 now" in line, line
    assert "start this run in a new run directory" in line
    assert _records(run_dir) == before  # config.yaml and versions.json: not a byte changed


@pytest.mark.parametrize(("written", "command"), [("dpo", "sft"), ("sft", "dpo")])
def test_another_jobs_run_directory_is_refused_before_anything_loads(
    tmp_path, written, command, capsys
):
    """strop sft on a DPO run's directory, strop dpo on an SFT run's: the same model and
    adapters, but not the same run (before: resumed, DPO's checkpoints carrying SFT's
    identity); refused from the identity, before the step count (60 is past both jobs'
    steps) and before the data (there is none)."""
    from strop.cli import main

    trained, run_dir = _checkpointed_run(tmp_path, "torch", written, 60)
    before = _records(run_dir)
    args = [command, "tiny", f"model.path={trained.model.path}", f"run_dir={run_dir}",
            "backend=torch", f"data.train_path={tmp_path / 'absent.jsonl'}", "mesh.fsdp=1",
            "mesh.tensor=-1"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith(
        f"was written by a different run: it is a strop {written} run's and this is strop "
        f"{command}. Resume it with strop {written}, or start this run in a new run directory."
    ), line
    assert _records(run_dir) == before


@pytest.mark.parametrize(("job", "key"), [("sft", "sft.steps"), ("ppo", "ppo.steps")])
def test_a_run_already_past_its_end_is_refused_and_keeps_its_metrics(tmp_path, job, key):
    from strop.rl.ppo import run_ppo
    from strop.sft.loop import run_sft

    trained, run_dir = _checkpointed_run(tmp_path, "torch", job, 60)
    metrics = b'{"step": 60, "train/loss": 1.0}\n{"step": 61, "train/loss": 1.0}\n'
    (run_dir / "metrics.jsonl").write_bytes(metrics)
    before = _records(run_dir)
    fewer = trained.model_copy(update={job: getattr(trained, job).model_copy(update={"steps": 3})})
    with pytest.raises(ConfigError) as err:
        (run_ppo if job == "ppo" else run_sft)(fewer)
    what = "iteration" if job == "ppo" else "step"
    assert str(err.value).startswith(
        f"run_dir {run_dir} already holds checkpoint {what} 60, past {key}=3: nothing to "
        f"train; raise {key} to continue the run"
    ), str(err.value)
    assert _records(run_dir) == before
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


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
    from strop.io.model_spec import check_context_length as check_positions
    from strop.io.model_spec import read_model_spec

    def check_context_length(config, job, longest=None):  # as preflight and the loops call it
        kind = run_kind(job)
        check_positions(
            read_model_spec(config.model.path), config.model.path, samples=kind.samples,
            prompts_cut_at_max_length=kind.trains, max_length=config.data.max_length,
            max_new_tokens=config.generation.max_new_tokens, longest_prompt=longest,
        )  # fmt: skip

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
