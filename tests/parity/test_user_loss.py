"""Your own policy loss (``ppo.policy_loss=path/to/file.py:function``): one function over
strop's ``ArrayOps``, from a user's file, trains two PPO iterations on JAX (traced inside
``jit``) and on torch to the same statistics and adapters (1e-4), with its declared needs
(the reference's log-probabilities, the rollouts' segments on packed rows) honoured.
"""

from __future__ import annotations

import numpy as np

from strop.io.model_spec import read_model_spec
from strop.rl.experience import build_experience, minibatches
from tests.parity.test_critic_free import ENGINES
from tests.parity.test_ppo_backends import make_config, rollout_batch

TOL = 1e-4
SCORES = np.array([1.0, 0.0, 0.25, 0.75])

USER_LOSS = '''
from strop.objectives.losses import policy_loss


@policy_loss(reads=("ref_logprobs",), sequence_level=True)
def gated_reinforce(ops, inputs, objective):
    """REINFORCE with the ratio, damped by each rollout's mean drift, plus a squared
    log-ratio to the reference."""
    xp = ops.xp
    log_ratio = inputs["logprobs"] - inputs["old_logprobs"]
    drift = ops.segment_mean(ops.stop_gradient(log_ratio), inputs["segments"], inputs["on"])
    to_ref = inputs["logprobs"] - inputs["ref_logprobs"]
    ratio = xp.exp(xp.clip(log_ratio, -20.0, 20.0))
    loss = -inputs["advantages"] * ratio * xp.exp(-xp.abs(drift)) + 0.5 * to_ref * to_ref
    return loss, {"to_ref": to_ref * to_ref, "drift": xp.abs(drift)}
'''


def test_a_loss_from_a_file_trains_the_same_on_jax_and_torch(tiny_model_dir, tmp_path):
    (tmp_path / "my_loss.py").write_text(USER_LOSS)
    model = tiny_model_dir("qwen2")
    config = make_config(
        model, "seed=5", "ppo.advantage_estimator=grpo", "ppo.kl_coef=0.1",
        "ppo.kl_estimator=k3", "optim.name=sgd", "optim.lr=1.0", "optim.weight_decay=0.0", "ppo.mini_batch_size=2",
        f"ppo.policy_loss={tmp_path / 'my_loss.py'}:gated_reinforce",
    )  # fmt: skip
    batch = rollout_batch(read_model_spec(model).vocab_size, seed=12)
    stats = {}
    engines = {}
    for name, build in ENGINES.items():
        engine = engines[name] = build(config, total_updates=4, checkpoint_dir=None)
        stats[name] = []
        for iteration in range(2):
            old, ref = engine.logprobs(batch), engine.logprobs(batch, reference=True)
            arrays, _ = build_experience(batch, SCORES, old, ref, None, config.ppo)
            rng = np.random.default_rng([config.seed, iteration])
            for mini in minibatches(arrays, config.ppo.mini_batch_size, "token_mean", rng):
                stats[name].append(engine.train_policy(mini, 1))
    assert len(stats["jax"]) == 4 and {"to_ref", "drift"} <= stats["jax"][0].keys()  # its terms
    assert stats["jax"][-1]["to_ref"] > 0 and stats["jax"][-1]["drift"] > 0  # it trained
    for jax_step, torch_step in zip(stats["jax"], stats["torch"], strict=True):
        assert jax_step.keys() == torch_step.keys()
        for key, value in jax_step.items():
            np.testing.assert_allclose(torch_step[key], value, rtol=TOL, atol=TOL, err_msg=key)
    after = {name: engine.lora_weights()["actor"] for name, engine in engines.items()}
    for path, pair in after["jax"].items():
        for x, y in zip(pair, after["torch"][path], strict=True):
            np.testing.assert_allclose(y, x, atol=TOL, rtol=TOL, err_msg=path)
