"""``lora.base_quantization`` (QLoRA): what the config, preflight and the backends refuse,
each in one line, before anything loads."""

from __future__ import annotations

import pytest

from strop import quantization
from strop.config import LoraConfig, load_config
from strop.errors import ConfigError
from strop.run.kinds import run_kind
from strop.run.preflight import preflight


def test_the_default_is_none_and_names_are_the_libraries():
    assert LoraConfig().base_quantization == "none"
    with pytest.raises(ConfigError, match=r"lora\.base_quantization"):
        load_config(None, ["lora.enabled=true", "lora.base_quantization=fp4"])


def test_full_fine_tuning_refuses_a_quantized_base():
    with pytest.raises(ConfigError, match=r"base_quantization=nf4 .* needs lora\.enabled=true"):
        load_config(None, ["lora.enabled=false", "lora.base_quantization=nf4"])


def test_vllm_refuses_a_quantized_base():
    """vLLM gets the adapter (or merged weights) over its own unquantized copy of the base:
    it would sample another policy than the one trained."""
    with pytest.raises(ConfigError, match=r"base_quantization=int8 with generation.engine=vllm"):
        load_config(None, ["lora.enabled=true", "lora.base_quantization=int8",
                           "generation.engine=vllm"])  # fmt: skip
    load_config(None, ["lora.enabled=true", "lora.base_quantization=int8"])  # native: fine


def run_config(tmp_path, *overrides):
    return load_config(
        None, [f"run_dir={tmp_path}", "lora.enabled=true", "lora.base_quantization=int8",
               *overrides],
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_both_backends_take_both_kinds_on_one_process(kind):
    for backend in ("jax", "torch"):  # JAX through Qwix, torch through bitsandbytes
        quantization.refuse_unsupported(kind, backend=backend, distributed=False)


def test_preflight_refuses_torchrun(tmp_path, monkeypatch, no_model_builds):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="runs on one process"):
        preflight(run_config(tmp_path, "backend=torch"), run_kind("sft"))


def test_preflight_refuses_a_missing_bitsandbytes(tmp_path, monkeypatch, no_model_builds):
    real = quantization.importlib.util.find_spec
    monkeypatch.setattr(
        quantization.importlib.util, "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real(name, *a),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="needs bitsandbytes: pip install 'strop\\[qlora\\]'"):
        preflight(run_config(tmp_path, "backend=torch"), run_kind("sft"))


def test_a_checkpoint_records_the_quantized_base(tmp_path):
    from strop.io.run_identity import run_identity

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    plain = run_identity(model, LoraConfig(enabled=True), "torch")["lora"]
    assert "base_quantization" not in plain  # checkpoints written before it still match
    nf4 = run_identity(model, LoraConfig(enabled=True, base_quantization="nf4"), "torch")
    assert nf4["lora"] == {**plain, "base_quantization": "nf4"}
