# ruff: noqa: F811 (inputs: a fixture imported from test_gold_refusal)
"""What a vLLM engine cannot do is refused in one line (exit 2) before any model loads: a
model vLLM cannot serve (here: heads of 16 dims, below what vLLM's CPU attention takes),
sleep mode on a platform without it, several processes, the sampler's log-probabilities as
old ones where vLLM has only the truncated distribution's."""

from __future__ import annotations

import pytest

from strop.engines.vllm import VLLM_LORA_RANKS, _max_lora_rank
from tests.integration.test_gold_refusal import inputs  # noqa: F401 (a fixture: 16-dim heads)

COMMANDS = [
    ("ppo", "ppo-lora-tiny", "data.train_path", "mesh.tensor=-1"),
    ("eval", "tiny", "eval.path", "mesh.data=-1"),
]


def refused(args, capsys):
    from strop.cli import main

    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def cli_args(inputs, tmp_path, command, recipe, path_key, mesh, *extra):
    return [command, recipe, f"model.path={inputs / 'model'}",
            f"{path_key}={inputs / 'good.jsonl'}", f"run_dir={tmp_path / 'run'}",
            "mesh.fsdp=1", mesh, "ppo.validate_every=0", "data.format=auto", "backend=torch",
            "generation.engine=vllm", *extra]  # fmt: skip


@pytest.mark.parametrize(("command", "recipe", "path_key", "mesh"), COMMANDS)
def test_a_model_vllm_cannot_serve_is_refused_before_any_model_loads(
    inputs,
    tmp_path,
    capsys,
    no_model_builds,
    command,
    recipe,
    path_key,
    mesh,
):
    line = refused(cli_args(inputs, tmp_path, command, recipe, path_key, mesh), capsys)
    assert line.startswith("error: generation.engine=vllm: vLLM's CPU attention cannot serve")
    assert "heads of 16 dims" in line and "generation.engine=native" in line


def test_sleep_mode_jax_processes_tensor_parallel_size_and_truncated_logprobs_are_refused(
    inputs, tmp_path, capsys, no_model_builds, monkeypatch
):
    args = cli_args(inputs, tmp_path, *COMMANDS[0])
    line = refused([*args, "generation.vllm_sleep=true"], capsys)
    assert "generation.vllm_sleep=true: vLLM's sleep mode needs a CUDA or ROCm device" in line
    line = refused([*args, "generation.vllm_tensor_parallel_size=2"], capsys)
    assert "generation.vllm_tensor_parallel_size=2 must divide the 1 process(es)" in line
    # vLLM has only the truncated distribution's log-probabilities there (docs/ppo.md)
    truncated = ["ppo.old_logprobs=sampler", "generation.temperature=0.7", "generation.top_p=0.9"]
    line = refused([*args, *truncated], capsys)
    assert line.startswith("error: ppo.old_logprobs=sampler with generation.engine=vllm, top_p=0.9")
    assert line.endswith("use ppo.old_logprobs=recompute (or temperature 1, or no top-p/top-k)")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    line = refused([*args, "backend=jax"], capsys)
    assert "JAX over several processes is not supported yet" in line


def test_the_engine_takes_the_smallest_lora_rank_vllm_allows():
    assert [_max_lora_rank(r) for r in (1, 2, 8, 9, 64, 65)] == [1, 8, 8, 16, 64, 128]
    assert VLLM_LORA_RANKS[-1] == 512
