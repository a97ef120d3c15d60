"""What `strop export` exports: the run its argument names, with the settings that run
was trained with (its config.yaml), the overrides given on top; and errors that say what
to pass."""

from __future__ import annotations

import json

import pytest

from strop.commands.export import export_config, run_export
from strop.config import dump_config, load_config
from strop.errors import CheckpointError, ConfigError


def trained_run(run_dir, *overrides: str):
    """A run directory as `strop ppo` leaves it: config.yaml with non-default settings."""
    config = load_config(
        "ppo-lora-tiny",
        [f"run_dir={run_dir}", "model.path=/models/tiny", "lora.rank=8",
         "ppo.advantage_estimator=grpo", "ppo.kl_in_reward=false", *overrides],
    )  # fmt: skip
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    return config


def test_the_run_directory_alone_says_how_the_run_was_trained(tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "x"
    trained = trained_run(run_dir)
    assert export_config(str(run_dir)) == trained
    assert export_config(f"run_dir={run_dir}") == trained
    # a recipe names the run by its run_dir; the run's config.yaml replaces the recipe
    assert export_config("ppo-lora-tiny", [f"run_dir={run_dir}"]) == trained
    # overrides still apply on top
    moved = export_config(str(run_dir), ["model.path=/elsewhere/tiny"])
    assert moved.model.path == "/elsewhere/tiny" and moved.lora.rank == 8
    # a relative run_dir from the current directory
    monkeypatch.chdir(tmp_path)
    assert export_config("runs/x").run_dir == "runs/x"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_export_demo_finds_the_demos_run_directory(tmp_path, monkeypatch, backend):
    monkeypatch.chdir(tmp_path)
    trained = trained_run(tmp_path / "runs" / f"demo-{backend}", f"backend={backend}")
    overrides = [] if backend == "jax" else ["backend=torch"]
    config = export_config("demo", overrides)
    assert config.run_dir == f"runs/demo-{backend}" and config.lora.rank == trained.lora.rank


def test_errors_say_what_to_pass(tmp_path, monkeypatch):
    (tmp_path / "bare").mkdir()
    with pytest.raises(ConfigError) as err:
        export_config(str(tmp_path / "bare"))
    assert f"{tmp_path / 'bare'} holds no config.yaml" in str(err.value)
    assert f"strop export RECIPE [OVERRIDES] run_dir={tmp_path / 'bare'}" in str(err.value)
    with pytest.raises(ConfigError, match="name the run to export"):
        export_config("backend=torch")

    # the demo ran on torch only: `strop export demo` (jax) names the directory there is
    monkeypatch.chdir(tmp_path)
    identity = tmp_path / "runs" / "demo-torch" / "checkpoints" / "60" / "identity.json"
    identity.parent.mkdir(parents=True)
    identity.write_text(json.dumps({"backend": "torch", "job": "ppo"}))
    with pytest.raises(CheckpointError) as err:
        run_export(export_config("demo"), tmp_path / "out", merged=False)
    message = str(err.value)
    assert message.startswith(f"no jax checkpoint in {tmp_path / 'runs' / 'demo-jax'}"), message
    assert "name the run to export: strop export RUN_DIR --adapter --out DIR" in message
    assert "(run directories beside it with checkpoints: runs/demo-torch)" in message


def test_an_override_the_checkpoint_refuses_says_how_to_export(tmp_path):
    from strop.assets import tiny_math_path
    from strop.io.run_identity import job_identity
    from strop.objectives.roles import RolePlan

    run_dir = tmp_path / "run"
    trained = trained_run(run_dir, f"model.path={tiny_math_path()}", "backend=torch")
    identity = run_dir / "checkpoints" / "2" / "identity.json"
    identity.parent.mkdir(parents=True)
    identity.write_text(
        json.dumps(job_identity(trained, "torch", job="ppo", roles=RolePlan.from_config(trained)))
    )
    with pytest.raises(CheckpointError) as err:  # refused before a model loads
        run_export(export_config(str(run_dir), ["lora.rank=4"]), tmp_path / "out", merged=False)
    assert "lora.rank is 8 in the checkpoint but 4 now. Export with the settings it was " in (
        str(err.value)
    )
    assert "name the run directory alone (strop export RUN_DIR" in str(err.value)
    assert not (tmp_path / "out").exists()
