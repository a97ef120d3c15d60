"""``merged_weights()`` (what the vLLM engine is fed on full fine-tuning) streams exactly
the tensors ``export_merged`` writes, on both backends, for SFT's policy and PPO's actor,
with LoRA (the adapter folded in) and without."""

from __future__ import annotations

import numpy as np
import pytest

from strop.backends import get_backend
from strop.config import load_config
from strop.io.hf import SafetensorsReader
from strop.io.model_spec import read_model_spec
from strop.io.run_identity import PolicyRun
from strop.objectives.roles import RolePlan


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_merged_weights_are_what_export_merged_writes(backend, lora, tiny_model_dir, tmp_path):
    overrides = [f"backend={backend}", f"model.path={tiny_model_dir('qwen2')}", "mesh.fsdp=1",
                 "mesh.data=-1", f"lora.enabled={str(lora).lower()}"]  # fmt: skip
    built = get_backend(backend)
    for name, model in (
        ("policy", built.build_policy(
            load_config("tiny", [*overrides, f"run_dir={tmp_path / 'sft'}"]),
            PolicyRun(total_steps=2))),
        ("actor", built.build_actor_critic(
            ppo := load_config("ppo-lora-tiny", [*overrides, f"run_dir={tmp_path / 'ppo'}"]),
            total_updates=2, plan=RolePlan.from_config(ppo), checkpoints=None)),
    ):  # fmt: skip
        written = SafetensorsReader(model.export_merged(tmp_path / f"{name}-merged"))
        streamed = list(model.merged_weights())
        assert [n for n, _ in streamed] != [] and sorted(n for n, _ in streamed) == sorted(
            written.names()
        )
        for tensor, array in streamed:
            np.testing.assert_array_equal(array, written.get(tensor), err_msg=tensor)


@pytest.mark.parametrize(("kind", "targets", "refused"), [
    ("qwen2_tied", "['.*_proj','lm_head']", True),
    ("qwen2_tied", "['.*_proj']", False),
    ("qwen2", "['.*_proj','lm_head']", False),
])  # fmt: skip
def test_merging_an_adapter_on_a_tied_head_is_refused(tiny_model_dir, kind, targets, refused):
    """A LoRA adapter on lm_head of a tied model (Gemma 3, SmolLM3) has no merged form that
    keeps the tie (before: `strop export --merged` wrote the shared table once, the
    head's adapter silently dropped); refused in one line, the adapter export says how."""
    from strop.commands.export import refuse_merging_a_tied_head
    from strop.errors import ConfigError

    config = load_config("tiny", [f"model.path={tiny_model_dir(kind)}", "lora.enabled=true",
                                  f"lora.target_modules={targets}"])  # fmt: skip
    if not refused:
        refuse_merging_a_tied_head(config, read_model_spec(config.model.path))
        return
    with pytest.raises(ConfigError, match="cannot merge into this model's tied embeddings"):
        refuse_merging_a_tied_head(config, read_model_spec(config.model.path))
