# ruff: noqa: F811 (inputs: a fixture imported from test_gold_refusal)
"""`generation.engine=vllm` where vLLM is not installed: `strop ppo` and `strop eval` stop
with one line naming the extra to install, exit 2, before any model is built. (vLLM's
own refusals, of models it cannot serve, are in tests/vllm_engine.)"""

from __future__ import annotations

import pytest

from tests.integration.test_gold_refusal import inputs  # noqa: F401 (a fixture)


@pytest.fixture
def without_vllm(monkeypatch):
    """``import vllm`` fails, as where it is not installed (also inside .venv-vllm)."""
    import builtins

    real_import = builtins.__import__

    def refusing(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError("No module named 'vllm'", name="vllm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refusing)


@pytest.mark.parametrize(
    ("command", "recipe", "path_key", "mesh"),
    [
        ("ppo", "ppo-lora-tiny", "data.train_path", "mesh.tensor=-1"),
        ("eval", "tiny", "eval.path", "mesh.data=-1"),
    ],
)
def test_vllm_engine_without_vllm_is_one_line_before_any_model_loads(
    inputs,
    tmp_path,
    capsys,
    no_model_builds,
    without_vllm,
    command,
    recipe,
    path_key,
    mesh,
):
    from strop.cli import main

    args = [command, recipe, f"model.path={inputs / 'model'}",
            f"{path_key}={inputs / 'good.jsonl'}", f"run_dir={tmp_path / 'run'}",
            "mesh.fsdp=1", mesh, "ppo.validate_every=0", "data.format=auto", "backend=torch",
            "generation.engine=vllm"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "error: generation.engine=vllm needs vLLM: pip install 'strop[vllm]'"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_engine_names_are_checked_by_the_config():
    from strop.config import load_config
    from strop.errors import ConfigError

    with pytest.raises(ConfigError, match=r"generation\.engine"):
        load_config("tiny", ["generation.engine=sglang"])


def test_vllm_sampler_logprobs_at_top_p_are_refused_before_anything_loads(
    inputs, tmp_path, capsys, no_model_builds, without_vllm
):
    """top-p below 1 at a temperature other than 1: vLLM has the untruncated distribution's
    log-probabilities only at temperature 1 (a config check: refused with or without
    vLLM)."""
    from strop.cli import main

    args = ["ppo", "ppo-lora-tiny", f"model.path={inputs / 'model'}",
            f"data.train_path={inputs / 'good.jsonl'}", f"run_dir={tmp_path / 'run'}",
            "mesh.fsdp=1", "mesh.tensor=-1", "ppo.validate_every=0", "data.format=auto",
            "backend=torch", "generation.engine=vllm", "ppo.old_logprobs=sampler",
            "generation.temperature=0.7", "generation.top_k=5"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "vLLM returns the untruncated distribution's log-probabilities there only" in line
    assert "use ppo.old_logprobs=recompute" in line
