"""One PPO update (critic + policy) on multi-turn rows, whose responses have holes: the
environment's tokens between the policy's turns (attended to, response_mask 0).

- JAX = torch: statistics and updated weights (SGD with lr=1: the weight change is the
  gradient), as tests/parity/test_ppo_backends.py holds single-turn rows.
- Environment tokens carry zero loss weight and zero gradient: changing every per-token
  input of the loss there (old and reference log-probs, advantages, returns, old values)
  changes no statistic and no updated weight; the KL and value statistics do not see them.
- Trailing environment tokens are padding to the update: attended to or not, the same
  statistics (the entropy's included) and weights.
- ``ppo.pack`` with holes gives what the same rows give unpacked.
"""

from __future__ import annotations

import numpy as np
import pytest

from strop.batch import packing
from strop.io.model_spec import read_model_spec
from strop.objectives.roles import RolePlan
from strop.rl.experience import build_experience, minibatches
from tests.parity.test_ppo_backends import (
    ENGINES,
    TOL,
    assert_adapters_close,
    experience_mini_batch,
    random_weights,
    sgd_config,
)

# Per row: (left padding, prompt length, response pattern): s = sampled, e = environment;
# 6 prompt columns + 10 response columns, right padding after the pattern.
ROWS = [
    (2, 4, "sssees" + "sess"),
    (0, 6, "sseees"),
    (3, 3, "sesssees"),
    (1, 5, "ssssee"),  # trailing environment tokens (an episode cut after the env spoke)
]
WIDTH = 16
LOSS_INPUTS = ("old_logprobs", "ref_logprobs", "advantages", "returns", "old_values", "values")


def holey_batch(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (len(ROWS), WIDTH)).astype(np.int32)
    attention = np.zeros_like(ids)
    response = np.zeros(ids.shape, np.float32)
    for row, (left, _prompt, pattern) in enumerate(ROWS):
        attention[row, left : 6 + len(pattern)] = 1
        response[row, 6 : 6 + len(pattern)] = [c == "s" for c in pattern]
    ids *= attention
    return {"input_ids": ids, "attention_mask": attention, "response_mask": response}


def env_tokens(mini: dict[str, np.ndarray]) -> np.ndarray:
    """Attended, not trained, after the prompt: the holes."""
    after_prompt = np.cumsum(mini["response_mask"], axis=1) > 0
    return (mini["attention_mask"] > 0) & (mini["response_mask"] == 0) & after_prompt


def update(engine, start, mini) -> tuple[dict, dict]:
    engine.set_lora_weights(**start)
    stats = {"critic": engine.train_critic(mini, 2), "policy": engine.train_policy(mini, 2)}
    return stats, engine.lora_weights()


def assert_same(a, b, tol: float) -> None:
    (stats_a, weights_a), (stats_b, weights_b) = a, b
    for part in ("critic", "policy"):
        assert stats_a[part].keys() == stats_b[part].keys()
        for key, value in stats_a[part].items():
            np.testing.assert_allclose(stats_b[part][key], value, atol=tol, rtol=tol,
                                       err_msg=f"{part}/{key}")  # fmt: skip
    assert_adapters_close(weights_a["actor"], weights_b["actor"], tol=tol)
    assert_adapters_close(weights_a["critic"], weights_b["critic"], tol=tol)
    np.testing.assert_allclose(weights_a["value_head"][0], weights_b["value_head"][0], atol=tol)


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model = tiny_model_dir("qwen2")
    config = sgd_config(model)
    batch = holey_batch(read_model_spec(model).vocab_size)
    engines = {name: build(config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None)
               for name, build in ENGINES.items()}  # fmt: skip
    start = random_weights(engines["jax"], seed=1)
    engines["jax"].set_lora_weights(**start)
    forwards = (engines["jax"].logprobs(batch), engines["jax"].logprobs(batch, reference=True),
                engines["jax"].values(batch))  # fmt: skip
    mini = experience_mini_batch(batch, forwards, config)
    assert env_tokens(mini).sum() == sum(p.count("e") for *_, p in ROWS)
    return model, config, batch, engines, start, mini


@pytest.mark.slow
def test_a_multi_turn_update_is_the_same_on_jax_and_torch(setup):
    _, _, _, engines, start, mini = setup
    runs = {name: update(engine, start, mini) for name, engine in engines.items()}
    assert_same(runs["jax"], runs["torch"], TOL)
    stats, after = runs["jax"]
    assert stats["policy"]["kl_loss"] != 0 and stats["policy"]["entropy"] != 0
    assert max(np.abs(after["actor"][p][1] - start["actor"][p][1]).max()
               for p in start["actor"]) > 1e-3  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_environment_tokens_carry_no_loss_and_no_gradient(setup, backend):
    _, _, _, engines, start, mini = setup
    engine = engines[backend]
    base = update(engine, start, mini)
    holes = env_tokens(mini)
    rng = np.random.default_rng(5)
    perturbed = dict(mini)
    changed = []
    for key in LOSS_INPUTS:
        if key in mini and np.issubdtype(mini[key].dtype, np.floating):
            noise = rng.normal(0, 3.0, mini[key].shape).astype(mini[key].dtype)
            perturbed[key] = np.where(holes, mini[key] + noise, mini[key])
            changed.append(key)
    assert {"old_logprobs", "ref_logprobs", "advantages", "returns"} <= set(changed), mini.keys()
    assert_same(base, update(engine, start, perturbed), 1e-6)
    # The same perturbation on the policy's own tokens does move the update: it is read.
    on = mini["response_mask"] > 0
    moved = {k: np.where(on, mini[k] + 1.0, mini[k]) for k in changed}
    stats, _ = update(engine, start, {**mini, **moved})
    assert stats["policy"]["kl_loss"] != pytest.approx(base[0]["policy"]["kl_loss"])
    # Trailing environment tokens are as good as padding (entropy, KL, weights).
    trailing = holes & (np.cumsum(on[:, ::-1], axis=1)[:, ::-1] == 0)
    assert trailing.any()
    padded = {k: np.where(trailing, 0, v) if v.shape == holes.shape else v
              for k, v in mini.items()}  # fmt: skip
    assert_same(base, update(engine, start, padded), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_packed_rows_with_holes_update_as_unpacked(setup, backend):
    _, config, batch, engines, start, _ = setup
    plan = packing.plan(batch["attention_mask"], multiple=2, buckets=backend == "jax",
                        bin_width=2, **packing.shared_prompts(batch, True))  # fmt: skip
    assert plan is not None and plan.bins < len(ROWS)  # the rows do pack
    scores = np.array([1.0, 0.0, 0.5, 1.0])
    ppo = config.ppo.model_copy(update={"pack": True, "pack_width": 2.0})
    packed_config = config.model_copy(update={"ppo": ppo})
    packed = ENGINES[backend](
        packed_config, total_updates=1, plan=RolePlan.from_config(packed_config),
        checkpoints=None,
    )  # fmt: skip
    seen = {}
    for pack, engine in ((False, engines[backend]), (True, packed)):
        engine.set_lora_weights(**start)
        forwards = (engine.logprobs(batch), engine.logprobs(batch, reference=True),
                    engine.values(batch))  # fmt: skip
        arrays, _ = build_experience(batch, scores, *forwards, config.ppo)
        mini = next(minibatches(arrays, 4, "token_mean", np.random.default_rng(3)))
        on = batch["response_mask"] > 0
        seen[pack] = ([x[on] for x in forwards], update(engine, start, mini))
    for x, y in zip(seen[False][0], seen[True][0], strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=1e-5)
    assert_same(seen[False][1], seen[True][1], TOL)
