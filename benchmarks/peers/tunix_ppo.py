"""Tunix's PPO (``tunix.rl.ppo.PpoLearner``) on strop's demo job; run inside the Tunix venv.

Prints one ``RESULT {...}`` JSON line: seconds of each PPO iteration (one iteration = 64
prompts x 1 sample, two mini-batch updates of actor and critic), mean reward per iteration.

    benchmarks/.venvs/tunix/bin/python benchmarks/peers/tunix_ppo.py \
        --model DIR --train train.jsonl --iterations 8
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax
import qwix
from common import job, print_result, read_problems, reward
from flax import nnx
from jax.sharding import AxisType
from transformers import AutoTokenizer
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen2 import params as qwen2_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import utils as rl_utils
from tunix.rl.ppo import ppo_learner
from tunix.rl.rollout import base_rollout

LORA_TARGETS = ".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def model_config(path: Path) -> qwen2.ModelConfig:
    hf = json.loads((path / "config.json").read_text())
    rope = hf.get("rope_parameters") or {}
    return qwen2.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf.get("tie_word_embeddings", False),
    )


def time_phases(cluster, learner, phases: dict[str, list[float]]) -> None:
    """Add each call's seconds to its phase's entry for the current iteration. JAX runs
    asynchronously: a phase may absorb time still in flight from the one before."""
    for phase, name in [
        ("generate", "generate"),
        ("logprobs", "get_old_per_token_logps"),
        ("values", "get_values"),
        ("train", "update_actor"),
        ("train", "update_critic"),
    ]:
        method = getattr(cluster, name)

        def timed(*args, _method=method, _phase=phase, **kwargs):
            began = time.perf_counter()
            out = _method(*args, **kwargs)
            totals = phases.setdefault(_phase, [])
            index = len(learner.seconds)
            totals.extend([0.0] * (index + 1 - len(totals)))
            totals[index] += time.perf_counter() - began
            return out

        setattr(cluster, name, timed)


class TimedPpoLearner(ppo_learner.PpoLearner):
    """Records the wall time of every global step (one PPO iteration)."""

    seconds: list[float]
    rewards: list[float]

    def _run_global_step(self, *args, **kwargs):
        began = time.perf_counter()
        super()._run_global_step(*args, **kwargs)
        cluster = self.rl_cluster  # wait for the updates still in flight
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        jax.block_until_ready(nnx.state(cluster.critic_trainer.model))
        self.seconds.append(time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job", help="the job's settings as JSON (default: strop's demo)")
    args = parser.parse_args()
    j = job(args.job)

    path = Path(args.model)
    config = model_config(path)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    with mesh:  # (jax.set_mesh makes an abstract mesh that Tunix 0.1.7 cannot shard onto)
        base = qwen2_params.create_model_from_safe_tensors(str(path), config, mesh)
        critic_base = qwen2_params.create_model_from_safe_tensors(str(path), config, mesh)
        provider = qwix.LoraProvider(
            module_path=LORA_TARGETS, rank=j["lora_rank"], alpha=float(j["lora_alpha"])
        )
        actor = qwix.apply_lora_to_model(
            base, provider, rngs=nnx.Rngs(args.seed), **base.get_model_input()
        )
        # A full-parameter critic: a LoRA critic's new value head is a plain nnx.Param,
        # which Tunix's trainer (it trains only LoRA params of a LoRA model) never updates.
        critic = rl_utils.create_critic_model(critic_base, seed=args.seed)
        reference = None  # the KL term is off: no reference forward, none loaded
        if j["kl_coef"]:
            reference = qwen2_params.create_model_from_safe_tensors(str(path), config, mesh)
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = read_problems(args.train)
    # Prompts are left-padded to this many tokens: the longest rounded up to 16, the
    # width strop's JAX backend gives its prompts (so both train on 80 + 48 columns here).
    longest = max(len(tokenizer(p["prompt"])["input_ids"]) for p in problems)
    prompt_length = -(-longest // 16) * 16

    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=j["max_new_tokens"],
        max_prompt_length=prompt_length,
        kv_cache_size=prompt_length + j["max_new_tokens"],
        temperature=j["temperature"],
        top_p=1.0,
        top_k=None,
        eos_tokens=[tokenizer.eos_token_id],
        seed=args.seed,
    )

    def adamw(lr: float) -> optax.GradientTransformation:
        b1, b2 = j["betas"]
        opt = optax.adamw(lr, b1=b1, b2=b2, eps=j["eps"], weight_decay=j["weight_decay"])
        clip = j["max_grad_norm"]
        return optax.chain(optax.clip_by_global_norm(clip), opt) if clip else opt

    roles = rl_cluster_lib.Role
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        critic=critic,
        reference=reference,
        tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: mesh for r in (roles.ACTOR, roles.CRITIC, roles.ROLLOUT)}
            | {roles.REFERENCE: mesh, roles.REWARD: mesh},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=adamw(j["lr"]),
                critic_optimizer=adamw(j["critic_lr"]),
                eval_every_n_steps=10**9,
                max_steps=args.iterations * (j["rollouts"] // j["mini_batch"]) * j["epochs"],
                mini_batch_size=j["mini_batch"],
                pbar_description=None,
            ),
            rollout_config=rollout,
        ),
    )

    rewards_seen: list[float] = []

    def gsm8k_reward(prompts, completions, gold, **_):
        scores = [reward(c, g) for c, g in zip(completions, gold, strict=True)]
        rewards_seen.extend(scores)
        return scores

    learner = TimedPpoLearner(
        rl_cluster=cluster,
        ppo_config=ppo_learner.PpoConfig(
            num_iterations=j["epochs"],
            gamma=j["gamma"],
            gae_lambda=j["lam"],
            beta=j["kl_coef"],
            epsilon_low=j["clip_low"],
            epsilon_high=j["clip_high"],
            epsilon_c=j["dual_clip"],
            clip_range_value=j["value_clip"],
        ),
        reward_fns=[gsm8k_reward],
        data_shuffle_seed=args.seed,
    )
    learner.seconds = []
    phases: dict[str, list[float]] = {}
    time_phases(cluster, learner, phases)

    order = np.random.default_rng(args.seed).permutation(len(problems))

    def batches():
        n = j["rollouts"]
        for start in range(0, args.iterations * n, n):
            rows = [problems[order[(start + i) % len(problems)]] for i in range(n)]
            yield {
                "prompts": [r["prompt"] for r in rows],
                "gold": [r["gold"] for r in rows],
            }

    with mesh:  # (jax.set_mesh makes an abstract mesh that Tunix 0.1.7 cannot shard onto)
        learner.train(batches())
    per_iteration = j["rollouts"]
    rewards = [
        float(np.mean(rewards_seen[i : i + per_iteration]))
        for i in range(0, len(rewards_seen), per_iteration)
    ]
    lora = nnx.state(cluster.actor_trainer.model, nnx.LoRAParam)
    print_result(
        learner.seconds,
        reward=rewards,
        phases={k: float(np.median(v[1:] or v)) for k, v in phases.items()},
        actor_steps=int(cluster.actor_trainer.train_steps),
        critic_steps=int(cluster.critic_trainer.train_steps),
        lora_params=int(sum(x.size for x in jax.tree.leaves(lora))),
    )


if __name__ == "__main__":
    main()
