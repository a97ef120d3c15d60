"""QLoRA runs keep their work: every base quantization (nf4, int8) on both backends saves a
checkpoint, resumes from it and exports it, through the same calls `strop sft` and
`strop export` make. A checkpoint holds only the adapters and their optimizer state; the
quantized base is rebuilt from ``model.path`` (torch's int8 layers once failed the save:
their row scales are state-dict entries that are neither parameters nor buffers)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from strop.commands.export import run_export
from strop.config import load_config
from strop.sft.loop import run_sft
from tests.integration.test_sft_run import sft_inputs  # noqa: F401 (a shared fixture)

pytest.importorskip("bitsandbytes")

QUANTIZATIONS = [
    # JAX's: the acceptance tier. Qwix compiles its quantized base for a minute and more on an
    # empty JAX cache (83 s for nf4 in `make test`, int8 longer); JAX's nf4 training and export
    # stay in `make test` through tests/integration/test_jax_qlora.py.
    pytest.param("jax", "nf4", id="jax-nf4", marks=pytest.mark.acceptance),
    pytest.param("jax", "int8", id="jax-int8", marks=pytest.mark.acceptance),
    pytest.param("torch", "nf4", id="torch-nf4"),
    pytest.param("torch", "int8", id="torch-int8"),
]


def qlora_config(inputs, run_dir, backend: str, kind: str, **overrides):
    model_dir, train = inputs
    settings = {
        "backend": backend, "model.path": model_dir, "data.train_path": train,
        "run_dir": run_dir, "lora.enabled": "true", "lora.base_quantization": kind,
        "sft.steps": 2, "sft.batch_size": 4, "sft.micro_batch_size": 4,
        "checkpoint.every_steps": 1, "logging.tensorboard": "false", "optim.lr": 1e-2,
        "mesh.fsdp": 1, "mesh.tensor": -1, **overrides,
    }  # fmt: skip
    return load_config("tiny", [f"{key}={value}" for key, value in settings.items()])


@pytest.mark.parametrize(("backend", "kind"), QUANTIZATIONS)
def test_a_qlora_run_saves_resumes_and_exports(sft_inputs, tmp_path, backend, kind):  # noqa: F811
    config = qlora_config(sft_inputs, tmp_path / "run", backend, kind)
    stopped = run_sft(config, stop_after=1)
    assert stopped.final_step == 1 and stopped.export_path is None
    resumed = run_sft(config)
    assert (resumed.resumed_from, resumed.final_step) == (1, 2)

    adapter = run_export(config, tmp_path / "adapter", merged=None)  # a LoRA run's own: adapter
    assert (adapter.job, adapter.step, adapter.merged) == ("sft", 2, False)
    exported = load_file(adapter.path / "adapter_model.safetensors")
    at_the_end = load_file(resumed.export_path / "adapter_model.safetensors")
    assert exported.keys() == at_the_end.keys()
    for name, value in exported.items():
        np.testing.assert_array_equal(value, at_the_end[name], err_msg=name)
    merged = run_export(config, tmp_path / "merged", merged=True)
    weights = load_file(merged.path / "model.safetensors")
    assert all(np.isfinite(w).all() for w in weights.values())
