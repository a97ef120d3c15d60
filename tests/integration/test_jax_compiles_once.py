"""A JAX PPO run compiles its steps in the first iteration, and after it at most the
few packed shapes it has not met yet.

Responses of varying lengths would each give the rollout batch a new width, and each new
width a new compile of the sampler, both forwards and both updates; the JAX actor pads
prompts and rollouts to one shape per run instead, from the run's longest prompt that the
loop tells it once (:mod:`strop.batch.columns`). With ``ppo.pack`` the
forwards and updates see rollouts packed into one of a few bin counts
(:mod:`strop.batch.packing`), or the batch as it is: at most one shape per bucket and one
unpacked each, whatever the responses. Counted here: every trace JAX makes (``jax.monitoring``'s trace event fires
for each jitted function and eager op traced for a new shape), during the iterations and
validations after the first.
"""

from __future__ import annotations

import json

import jax
import pytest

from strop.batch import packing
from strop.rl import ppo as ppo_module
from tests.integration.test_ppo_run import config_for, task  # noqa: F401  (fixture)

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
PACKED = {"logprobs", "values", "critic_and_policy_update"}  # what takes packed batches
SHAPES = len(packing.BUCKETS) + 1  # a packed bin count, or the batch as it is


@pytest.fixture
def early_stopping_task(task, tmp_path):  # noqa: F811
    """The tiny task with a model whose EOS ids are a third of the vocabulary, so that
    responses end after a few tokens and each rollout's longest differs."""
    model = tmp_path / "model"
    model.mkdir()
    for item in (task / "model").iterdir():
        (model / item.name).symlink_to(item)
    config = json.loads((task / "model" / "config.json").read_text())
    config["eos_token_id"] = list(range(3, config["vocab_size"], 3))
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(
    "pack",  # the unpacked run (60 s on 2 cores) in the acceptance tier: packing is the default
    [pytest.param(False, marks=pytest.mark.acceptance), True],
)
def test_no_compile_after_the_first_iteration(
    task,  # noqa: F811
    early_stopping_task,
    tmp_path,
    monkeypatch,
    pack,
):
    traces: list[str] = []
    plans = []
    plan = packing.plan

    def recorded_plan(*args, **kwargs):
        plans.append(plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(packing, "plan", recorded_plan)

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == TRACE_EVENT:
            traces.append(str(kwargs.get("fun_name")))

    widths: list[int] = []
    iteration, validate = ppo_module.PpoLoop.iteration, ppo_module.PpoLoop.validate
    per_call: list[tuple[str, list[str]]] = []

    def counted(name, fn):
        def run(*args, **kwargs):
            before = len(traces)
            out = fn(*args, **kwargs)
            per_call.append((name, traces[before:]))
            return out

        return run

    class Recorded(ppo_module.Rollout):
        @classmethod
        def from_generation(cls, prompts, generation, tokenizer):
            widths.append(generation.tokens.shape[1])
            return super().from_generation(prompts, generation, tokenizer)

    monkeypatch.setattr(ppo_module.PpoLoop, "iteration", counted("iteration", iteration))
    monkeypatch.setattr(ppo_module.PpoLoop, "validate", counted("validation", validate))
    monkeypatch.setattr(ppo_module, "Rollout", Recorded)
    config = config_for(
        task, tmp_path / "run", "jax", f"model.path={early_stopping_task}",
        "ppo.steps=5", "ppo.validate_every=2", "checkpoint.every_steps=100",
        "ppo.prompts_per_step=8", "ppo.num_generations_per_prompt=2", "ppo.mini_batch_size=16",
        "ppo.micro_batch_size=8", f"ppo.pack={str(pack).lower()}",
        "mesh.fsdp=2",  # weights sharded: the sampler's inference layout is traced once too
    )  # fmt: skip
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        ppo_module.run_ppo(config)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)

    assert len(set(widths)) >= 3, widths  # the rollouts really had different widths
    names = [name for name, _ in per_call]
    assert names[:2] == ["validation", "iteration"] and names.count("iteration") == 5, names
    assert per_call[1][1], "the first iteration traced nothing: the counter is broken"
    later = {name: new for name, new in per_call[2:] if new}
    if not pack:
        assert not plans, "ppo.pack=false packed"
        assert not later, f"traced after the first iteration: {later}"
        return
    assert any(p is not None for p in plans), "nothing was packed: the test tests nothing"
    unexpected = {name: set(new) - PACKED for name, new in later.items() if set(new) - PACKED}
    assert not unexpected, f"traced after the first iteration: {unexpected}"
    for name in PACKED:
        assert traces.count(name) <= SHAPES, (name, traces.count(name), traces)
