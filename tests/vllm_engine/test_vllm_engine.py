"""generation.engine=vllm against the native sampler and transformers ``generate``.

The same tiny models as the native sampler's parity tests: greedy tokens equal, the
sampled tokens' log-probabilities equal the trainer's teacher-forced ones, and after an
update (LoRA or full fine-tuning) the engine samples from the updated actor.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from strop.assets import tiny_math_path
from strop.backends import get_backend
from strop.config import load_config
from strop.engines.vllm import VllmEngine
from strop.engines.vllm_sync import VllmRollouts
from strop.generation import SamplingParams
from strop.objectives.roles import RolePlan

LOGPROB_BOUND = 2e-4  # float32: vLLM's and the trainer's kernels differ in reduction order


@pytest.fixture(scope="module")
def tiny_dir():
    """The shipped tiny-math model: heads of 32 dims (vLLM's CPU attention takes no fewer)."""
    return tiny_math_path()


def config_for(model_dir, tmp_path, *overrides):
    return load_config(
        "ppo-lora-tiny",
        [
            f"model.path={model_dir}",
            f"run_dir={tmp_path / 'run'}",
            "backend=torch",
            "generation.engine=vllm",
            "generation.vllm_memory_fraction=0.1",
            "generation.max_new_tokens=24",
            *overrides,
        ],
    )


def prompts_for(vocab: int, rows: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(3, 12, rows)]


def generate(model, prompts, params, seed=0):
    return model.generate(prompts, params, seed=seed, eos_ids=[2], pad_id=0)


def transformers_greedy(model_dir, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=2, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        out.append(ids[: ids.index(2) + 1] if 2 in ids else ids)
    return out


def files_under(*roots):
    return sorted(str(path) for root in roots for path in root.rglob("*") if path.is_file())


@pytest.mark.parametrize(
    ("backend", "lora", "sync"),
    [
        ("torch", True, "adapter"),
        ("jax", True, "adapter"),
        ("torch", True, "merged"),
        ("torch", False, "adapter"),
        ("jax", False, "adapter"),
    ],
    ids=["torch-lora", "jax-lora", "torch-merged", "torch-full", "jax-full"],
)
def test_greedy_tokens_equal_native_and_transformers_before_and_after_an_update(
    tiny_dir, tmp_path, lora, backend, sync, monkeypatch
):
    """The actor reaches vLLM in memory: its adapter's tensors (the JAX trainer's in PEFT's
    names), or its LoRA-merged weights; no sync writes a file (run dir, temp dir)."""
    config = config_for(
        tiny_dir, tmp_path, f"lora.enabled={str(lora).lower()}", f"backend={backend}",
        "mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1", f"generation.vllm_sync={sync}",
    )  # fmt: skip
    model = get_backend(backend).build_actor_critic(
        config, total_updates=4, plan=RolePlan.from_config(config), checkpoints=None
    )
    engine = VllmEngine(config)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where a sync's temp files would go
    watched = (tmp_path / "run", temp)
    before = files_under(*watched)
    rollouts = VllmRollouts(model, engine, config)
    try:
        prompts = prompts_for(384, rows=8)  # rows split over JAX's 8 data shards
        greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
        served, native = generate(rollouts, prompts, greedy), generate(model, prompts, greedy)
        assert served.responses() == native.responses()
        assert served.responses() == transformers_greedy(tiny_dir, prompts, 24)
        assert served.finish_reasons == native.finish_reasons

        # an update moves the actor; the next generate syncs it into the engine
        batch = _update_batch(model, prompts, native)
        model.train_policy(batch, 1)
        rollouts.mark_stale()  # as the PPO loop does after an update
        after = generate(rollouts, prompts, greedy)
        assert rollouts.syncs == 2
        assert after.responses() == generate(model, prompts, greedy).responses()
        assert after.responses() != served.responses(), "the update changed nothing"
        assert files_under(*watched) == before, "a sync wrote files"
        metrics = rollouts.metrics()
        assert metrics["sync/bytes"] > 0 and metrics["timing/sync"] > 0
    finally:
        rollouts.close()


def _update_batch(model, prompts, generation):
    """A policy mini-batch from ``generation`` with large advantages (a visible update)."""
    from strop.rl.rollout import Rollout

    rollout = Rollout.from_generation(prompts, generation, _Decode())
    batch = rollout.teacher_forcing_batch(0)
    old = model.logprobs(batch)
    mask = batch["response_mask"]
    rng = np.random.default_rng(1)
    advantages = rng.normal(size=mask.shape).astype(np.float32) * 5 * mask
    weights = mask / mask.sum()
    return {
        **batch, "old_logprobs": old, "advantages": advantages, "loss_weights": weights,
        "returns": np.zeros_like(old), "old_values": np.zeros_like(old),
    }  # fmt: skip


def test_sampled_logprobs_match_the_trainers_teacher_forced_ones(tiny_dir, tmp_path):
    config = config_for(tiny_dir, tmp_path, "generation.temperature=0.7")
    model = get_backend("torch").build_actor_critic(
        config, total_updates=4, plan=RolePlan.from_config(config), checkpoints=None
    )
    rollouts = VllmRollouts(model, VllmEngine(config), config)
    try:
        prompts = prompts_for(384, rows=8)
        params = SamplingParams(max_new_tokens=24, temperature=0.7)
        served = generate(rollouts, prompts, params, seed=3)
        from strop.rl.rollout import Rollout

        rollout = Rollout.from_generation(prompts, served, _Decode())
        batch = rollout.teacher_forcing_batch(0)
        trainer = model.logprobs(batch)
        sampled = rollout.align(rollout.logprobs)
        mask = batch["response_mask"] > 0
        assert np.abs(trainer - sampled)[mask].max() < LOGPROB_BOUND
        # per-row seeds: the same call again gives the same samples
        again = generate(rollouts, prompts, params, seed=3)
        assert again.responses() == served.responses()
        assert generate(rollouts, prompts, params, seed=4).responses() != served.responses()
    finally:
        rollouts.close()


class _Decode:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))
