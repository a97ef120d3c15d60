"""The rollout engine protocol (:mod:`strop.engines`): the loops hold the model they train
and the engine they sample from as two things, and mark the engine stale after each call
that changes the actor; vLLM's engine then syncs the actor before its next sample. No
vLLM here: its engine is a fake that records what it was given."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from strop.backends import get_backend
from strop.config import load_config
from strop.config.sections import GenerationConfig
from strop.engines import ENGINES, NativeEngine, RolloutEngine
from strop.engines.vllm_sync import VllmRollouts
from strop.generation import Generation, SamplingParams
from strop.rl.ppo import PpoLoop
from strop.run.job import Job, run_steps
from strop.run.kinds import run_kind
from strop.run.preflight import RunFacts
from strop.run.progress import RunProgress

PARAMS = SamplingParams(max_new_tokens=2, temperature=1.0)


class FakeActor:
    """An ``ActorCritic`` as far as the loop's mutating calls and vLLM's sync go."""

    is_main = True

    def __init__(self, latest=None):
        self.calls, self.latest = [], latest

    def _record(self, name):
        self.calls.append(name)
        return {"loss": 0.0}

    def train_policy(self, batch, micro_batches):
        return self._record("train_policy")

    def train_critic(self, batch, micro_batches):
        return self._record("train_critic")

    def train_critic_and_policy(self, batch, micro_batches):
        return self._record("train_critic"), self._record("train_policy")

    def set_lora_weights(self, **weights):
        self.calls.append("set_lora_weights")

    def latest_checkpoint(self):
        return self.latest

    def restore_checkpoint(self, step):
        self.calls.append("restore_checkpoint")
        return {"step": step}

    def load_adapter(self, path):
        self.calls.append("load_adapter")

    def export_adapter(self, path, overwrite=False):
        self.calls.append("export_adapter")
        return Path(path)

    def actor_adapter(self):
        return {"model.layers.0.self_attn.q_proj": (np.ones((2, 8), np.float32),) * 2}

    def merged_weights(self):
        yield "model.embed_tokens.weight", np.ones((4, 8), np.float32)

    def sample(self, prompts, params, decoding):
        self.calls.append("native sample")
        return _generation(len(prompts))


class FakeVllm:
    """A ``VllmEngine``: records the adapters it is given and the samples it draws."""

    rank, world_size = 0, 1

    def __init__(self):
        self.calls = []

    def use_adapter(self, tensors, config):
        self.calls.append("use_adapter")
        self.adapter = tensors, config
        return sum(tensor.nbytes for tensor in tensors.values())

    def load_weights(self, weights):
        self.calls.append("load_weights")
        return sum(array.nbytes for _, array in weights)

    def wake_up(self):
        pass

    def sample(self, prompts, params, decoding):
        self.calls.append("sample")
        return _generation(len(prompts))

    def close(self):
        pass


def _generation(rows):
    return Generation(
        np.zeros((rows, 1), np.int32), np.zeros((rows, 1), np.float32),
        np.ones(rows, np.int32), ["length"] * rows,
    )  # fmt: skip


def _config(tmp_path, *overrides):
    return load_config(
        "ppo-lora-tiny", [f"run_dir={tmp_path}", "backend=torch", "ppo.steps=2", *overrides]
    )


def _generate(engine):
    return engine.generate([[5, 6]], PARAMS, seed=0, eos_ids=[2], pad_id=0)


def _loop(model, rollouts):
    """A ``PpoLoop`` with only what its update step reads."""
    loop = object.__new__(PpoLoop)
    loop.model, loop.rollouts = model, rollouts
    return loop


def test_the_schemas_engines_are_the_registered_ones():
    assert get_args(GenerationConfig.model_fields["engine"].annotation) == tuple(ENGINES)


def test_each_update_of_the_actor_syncs_vllm_before_the_next_sample(tmp_path):
    model, vllm = FakeActor(), FakeVllm()
    rollouts = VllmRollouts(model, vllm, _config(tmp_path))
    assert isinstance(rollouts, RolloutEngine) and isinstance(NativeEngine(model), RolloutEngine)
    assert not hasattr(rollouts, "train_policy"), "the engine is no proxy of the model"
    _generate(rollouts)  # a new engine serves model.path: the actor is pushed first
    assert (rollouts.syncs, vllm.calls) == (1, ["use_adapter", "sample"])
    _generate(rollouts)
    assert rollouts.syncs == 1, "nothing changed the actor"

    loop = _loop(model, rollouts)
    for roles in [("critic",), ("policy",), ("critic", "policy")]:
        before = rollouts.syncs
        loop._train(roles, {}, 1)
        assert rollouts.stale == ("policy" in roles), roles  # the critic is not sampled
        _generate(rollouts)
        assert rollouts.syncs == before + ("policy" in roles), roles

    # what no loop calls, but changes the actor all the same (the old proxy missed it):
    # whoever calls it marks the engine stale
    before = rollouts.syncs
    model.set_lora_weights(actor={})
    rollouts.mark_stale()
    _generate(rollouts)
    assert rollouts.syncs == before + 1
    assert vllm.calls[-2:] == ["use_adapter", "sample"]


@pytest.mark.parametrize("source", ["checkpoint", "adapter"])
def test_a_restored_checkpoint_or_a_loaded_adapter_marks_the_engine_stale(tmp_path, source):
    marks = []

    class Recording(NativeEngine):
        def mark_stale(self):
            marks.append(self.model.calls[-1])  # what the loop had just called

    if source == "checkpoint":  # a finished run run again: restored, then exported
        model, config, stop_after = FakeActor(latest=2), _config(tmp_path), None
    else:
        model = FakeActor()
        config = _config(tmp_path, f"lora.restore_path={tmp_path / 'adapter'}")
        stop_after = 0
    steps = type("NoSteps", (), {"model": model, "always_written": ()})()
    steps.restore_counters = lambda saved: None
    facts = RunFacts(run_kind("ppo"), get_backend(config.backend))
    job = Job(facts, RunProgress("ppo", 2, {}, enabled=False))
    run_steps(config, steps, job, total=2, stop_after=stop_after, rollouts=Recording(model))
    assert marks == [{"checkpoint": "restore_checkpoint", "adapter": "load_adapter"}[source]]


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_a_sync_hands_vllm_the_actor_in_memory_and_reports_its_time_and_bytes(tmp_path, sync):
    """adapter: PEFT's tensor names and adapter_config; merged: the merged weights. The
    metrics are those of the syncs since the last report (PPO logs them per iteration)."""
    vllm = FakeVllm()
    config = _config(tmp_path, f"generation.vllm_sync={sync}")
    rollouts = VllmRollouts(FakeActor(), vllm, config)
    _generate(rollouts)
    if sync == "adapter":
        tensors, adapter_config = vllm.adapter
        assert sorted(tensors) == [
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        ]
        assert (adapter_config["r"], adapter_config["lora_alpha"]) == (
            config.lora.rank, config.lora.alpha,
        )  # fmt: skip
    assert vllm.calls == [{"adapter": "use_adapter", "merged": "load_weights"}[sync], "sample"]
    metrics = rollouts.metrics()
    assert metrics["sync/bytes"] == 128 and metrics["timing/sync"] > 0
    assert rollouts.metrics() == {"timing/sync": 0.0, "sync/bytes": 0.0}  # reported once
    assert NativeEngine(FakeActor()).metrics() == {}
