"""The ``strop`` command as a user runs it: ``python -m strop`` in a fresh process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import strop as strop_package


def strop(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strop", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["bad_key.yaml"], "unknown key 'optim.lrr'"),
        (["bad_type.yaml"], "sft.steps"),
        (["tiny", "optim.lr"], "bad override 'optim.lr'"),
        (["missing.yaml"], "not found"),
    ],
)
def test_config_errors_are_one_line_and_exit_2(tmp_path: Path, args, expected) -> None:
    (tmp_path / "bad_key.yaml").write_text(yaml.safe_dump({"optim": {"lrr": 1e-3}}))
    (tmp_path / "bad_type.yaml").write_text(yaml.safe_dump({"sft": {"steps": "many"}}))
    result = strop("config", "show", *args, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_config_show_prints_resolved_yaml(tmp_path: Path) -> None:
    result = strop("config", "show", "tiny", "optim.lr=3e-5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["optim"]["lr"] == 3e-5 and shown["run_dir"] == "runs/tiny"


def test_version(tmp_path: Path) -> None:
    result = strop("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == f"strop {strop_package.__version__}\n"


def test_recipes_lists_every_builtin_with_its_summary(capsys) -> None:
    from strop.cli import main
    from strop.config.sources import builtin_recipes

    with pytest.raises(SystemExit) as info:
        main(["recipes"])
    assert info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == builtin_recipes()
    assert any(line.startswith("ppo-lora-tiny ") and "LoRA-PPO" in line for line in lines)


def test_ppo_help_names_the_critic_free_estimators(capsys) -> None:
    from strop.cli import main

    with pytest.raises(SystemExit) as info:
        main(["ppo", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ppo.advantage_estimator=grpo, rloo or reinforce_pp" in text


def test_info_reports_versions_and_backends(tmp_path: Path) -> None:
    result = strop("info", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "jax" in result.stdout and "torch" in result.stdout and "safetensors" in result.stdout
    assert "backend jax" in result.stdout
    # the extras that decide what works: each a row, its version or how to install it
    text = " ".join(result.stdout.split())
    for package, extra in (("vllm", "vllm"), ("bitsandbytes", "qlora"), ("wandb", "wandb")):
        assert f"│ {package} │" in text, result.stdout
        assert importlib.util.find_spec(package) or f"strop[{extra}]" in text, result.stdout


@pytest.mark.parametrize(
    ("command", "overrides", "key"),
    [
        ("sft", ["optim.lr=-1"], "optim.lr"),
        ("sft", ["lora.rank=0"], "lora.rank"),
        ("sft", ["lora.rank=abc"], "lora.rank"),
        ("sft", ["optim.warmup_steps=-5"], "optim.warmup_steps"),
        ("sft", ["sft.batch_size=6", "sft.micro_batch_size=4"], "sft.batch_size"),
        ("sft", ["lora.target_modules=['(']"], "lora.target_modules"),
        ("sft", ["train.skip_nonfinite=maybe"], "train.skip_nonfinite"),
        ("ppo", ["ppo.clip_low=-0.1"], "ppo.clip_low"),
        ("ppo", ["ppo.mini_batch_size=5"], "ppo.mini_batch_size"),
        ("ppo", ["ppo.reference_adapter=x", "lora.enabled=false"], "ppo.reference_adapter"),
        ("ppo", ["critic.model_path=x", "lora.enabled=true"], "critic.model_path"),
        ("eval", ["eval.num_samples=0"], "eval.num_samples"),
        ("ppo", ["generation.compile=reduce-overhead"], "generation.compile"),  # backend=jax
        (
            "eval",
            ["backend=torch", "generation.engine=vllm", "generation.compile=default"],
            "generation.compile=",
        ),
        ("ppo", ["generation.compile=sometimes"], "generation.compile"),
        (
            "ppo",
            ["backend=torch", "critic.shared_trunk=true", "lora.enabled=false"],
            "critic.shared_trunk",
        ),
        (
            "ppo",
            [
                "backend=torch",
                "critic.shared_trunk=true",
                "ppo.advantage_estimator=grpo",
                "ppo.kl_in_reward=false",
            ],
            "critic.shared_trunk",
        ),
        (
            "ppo",
            ["backend=torch", "critic.shared_trunk=true", "ppo.critic_warmup_steps=2"],
            "ppo.critic_warmup_steps",
        ),
        # against the devices (jax sees 8 in tests; torch is one process here)
        ("sft", ["mesh.data=3"], "mesh sizes data=3"),
        ("sft", ["sft.micro_batch_size=4", "mesh.fsdp=-1"], "sft.micro_batch_size=4"),
        ("sft", ["backend=torch", "mesh.data=2", "mesh.fsdp=1"], "mesh sizes data=2"),
        ("ppo", ["ppo.micro_batch_size=4", "ppo.validate_every=0"], "ppo.micro_batch_size=4"),
        ("eval", ["mesh.tensor=3", "mesh.fsdp=1", "eval.path=/nonexistent/eval.jsonl"], "mesh"),
    ],
)
def test_bad_values_fail_before_any_model_loads(command, overrides, key, capsys) -> None:
    """model.path points nowhere: had anything been loaded first, the error would name it."""
    from strop.cli import main

    recipe = "ppo-lora-tiny" if command == "ppo" else "tiny"
    missing = ["model.path=/nonexistent/model", "data.train_path=/nonexistent/train.jsonl"]
    with pytest.raises(SystemExit) as info:
        main([command, recipe, *missing, *overrides])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}"), lines
    assert "nonexistent" not in lines[0]


@pytest.mark.parametrize("command", ["sft", "eval"])
def test_a_wrong_model_path_is_named_as_such(command, tmp_path, capsys) -> None:
    """Before, it was reported as a problem with a "tokenizer directory"."""
    from strop.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "completion": " 2"}\n')
    args = ["tiny", f"model.path={tmp_path / 'no-model'}", f"data.train_path={data}",
            f"eval.path={data}", f"run_dir={tmp_path / 'run'}",
            "sft.micro_batch_size=8"]  # rows that split over the tests' 8 CPU devices  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main([command, *args])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"error: model.path={tmp_path / 'no-model'}: no such directory; give a "
                     "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"]  # fmt: skip


def test_a_hub_name_as_model_path_says_how_to_download_it(tmp_path, capsys) -> None:
    from strop.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "completion": " 2"}\n')
    args = ["tiny", "model.path=Qwen/Qwen2.5-0.5B", f"data.train_path={data}",
            f"run_dir={tmp_path / 'run'}", "sft.micro_batch_size=8"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(["sft", *args])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: model.path=Qwen/Qwen2.5-0.5B: no such directory; strop loads only local "
        "directories: download it first with `huggingface-cli download Qwen/Qwen2.5-0.5B "
        "--local-dir models/Qwen2.5-0.5B` and set model.path=models/Qwen2.5-0.5B"
    ]


def test_export_without_a_kind_takes_the_runs_own(tmp_path, capsys) -> None:
    """`strop export RUN_DIR --out DIR` exports what the run trained (with LoRA the
    adapter; before: "choose exactly one of --adapter or --merged"); both is an error."""
    from strop.cli import main

    args = ["tiny", "backend=torch", f"run_dir={tmp_path / 'run'}", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as info:
        main(["export", *args])
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: no torch checkpoint in "), line  # past the flags
    with pytest.raises(SystemExit) as info:
        main(["export", *args, "--adapter", "--merged"])
    assert capsys.readouterr().err == "error: choose one of --adapter or --merged, not both\n"


def test_export_names_the_backend_that_wrote_the_run(tmp_path, capsys) -> None:
    """Before, `strop export backend=torch` on a JAX run said "no torch checkpoint ...;
    train first"."""
    from strop.cli import main

    identity = tmp_path / "run" / "checkpoints" / "3" / "identity" / "metadata"
    identity.parent.mkdir(parents=True)
    identity.write_text(json.dumps({"backend": "jax", "job": "sft"}))
    args = ["tiny", "backend=torch", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as info:
        main(["export", *args, "--adapter", "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "holds checkpoints the jax backend wrote (steps 3)" in line
    assert "Resume with backend=jax" in line and not (tmp_path / "out").exists()
