"""``distill.loss=jsd``'s student update (``ActorCritic.train_jsd``) on both backends.

From the same student adapter, the same frozen teacher (a model of its own: another tiny
Qwen2, its head tied to its embeddings) and the same rollout rows, one update with two
micro-batches gives the same JSD, gradient norm and updated adapter on JAX and torch. SGD
with lr=100 and no clipping makes "updated - start" 100 times the gradient, so the weights
compare gradients, scaled to where the float32 tolerance 1e-4 is a fine one (the JSD and its
gradient norm are about 0.01 here). The JSD itself is held to TRL's loss on the logits of
the engines' own models in ``tests/parity/test_distill_heads.py``; here it must be > 0 (the
two models differ) and the teacher must come out unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from strop.io.model_spec import read_model_spec
from strop.objectives.distill import JsdObjective
from strop.objectives.roles import RolePlan
from strop.run.teacher import teacher_config
from tests.parity.test_ppo_backends import (
    ENGINES,
    assert_adapters_close,
    make_config,
    rollout_batch,
)

SETTINGS = ("distill.beta=0.3", "distill.temperature=0.7", "distill.chunk_tokens=5")


def distill_config(student: str, teacher: str):
    return make_config(
        student, "optim.name=sgd", "optim.lr=100", "optim.weight_decay=0.0",
        "optim.max_grad_norm=null", "ppo.advantage_estimator=grpo", f"distill.teacher={teacher}",
        "distill.loss=jsd", *SETTINGS,
    )  # fmt: skip


def scrambled(adapter: dict, seed: int) -> dict:
    """``adapter``'s shapes filled with N(0, 0.1): a student that is not its base."""
    rng = np.random.default_rng(seed)
    return {
        path: (rng.normal(0, 0.1, a.shape).astype(np.float32),
               rng.normal(0, 0.1, b.shape).astype(np.float32))
        for path, (a, b) in adapter.items()
    }  # fmt: skip


def build(backend: str, config):
    return ENGINES[backend](
        config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
    )


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return tiny_model_dir("qwen2"), tiny_model_dir("qwen2_tied")


def test_one_jsd_update_is_the_same_on_jax_and_torch(models):
    student_dir, teacher_dir = models
    config = distill_config(student_dir, teacher_dir)
    objective = JsdObjective.from_config(config)
    batch = rollout_batch(read_model_spec(student_dir).vocab_size, seed=7)
    mask = batch["response_mask"]
    mini = {**batch, "loss_weights": (mask / mask.sum()).astype(np.float32)}  # token mean
    stats, after, start = {}, {}, None
    for backend in ENGINES:
        student, teacher = build(backend, config), build(backend, teacher_config(config))
        start = start or scrambled(student.lora_weights()["actor"], seed=1)
        student.set_lora_weights(actor=start)
        teacher_before = teacher.logprobs(batch, reference=True)
        stats[backend] = student.train_jsd(mini, 2, teacher, objective)
        after[backend] = student.lora_weights()["actor"]
        np.testing.assert_array_equal(teacher.logprobs(batch, reference=True), teacher_before)

    assert stats["jax"].keys() == stats["torch"].keys()
    for key, value in stats["jax"].items():
        np.testing.assert_allclose(value, stats["torch"][key], rtol=1e-5, atol=1e-8, err_msg=key)
    assert stats["jax"]["jsd"] == stats["jax"]["loss"] > 1e-3
    assert stats["jax"]["skipped"] == 0
    assert_adapters_close(after["jax"], after["torch"])
    moved = max(np.abs(after["jax"][p][1] - start[p][1]).max() for p in start)
    assert moved > 0.1  # the update did something
