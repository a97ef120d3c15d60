"""TRL's PPO (``trl.experimental.ppo.PPOTrainer``, trl 1.12) on strop's demo job; run inside
the TRL venv.

Prints one ``RESULT {...}`` JSON line: seconds of each PPO iteration (one iteration = 64
prompts x 1 sample, two mini-batch updates), mean reward per iteration.

TRL's PPO scores a response with a reward *model* (``get_reward(reward_model, ...)``); here
that call is replaced, for a stand-in reward module only, by the rule reward on the decoded
response (the same as strop's ``gsm8k`` reward on these problems).

    benchmarks/.venvs/trl/bin/python benchmarks/peers/trl_ppo.py \
        --model DIR --train train.jsonl --iterations 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from common import job, print_result, read_problems, reward
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)
from trl.experimental.ppo import PPOConfig, PPOTrainer
from trl.experimental.ppo import ppo_trainer as trl_ppo

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class RuleReward(torch.nn.Module):
    """Stands in for TRL's reward model: the gsm8k rule reward on decoded responses."""

    def __init__(self, tokenizer, gold_of: dict[str, str]):
        super().__init__()
        self.tokenizer = tokenizer
        self.gold_of = gold_of
        self.seen: list[float] = []

    def score(self, query_responses: torch.Tensor, pad_id: int, context_length: int):
        queries = query_responses[:, :context_length]
        responses = query_responses[:, context_length:]
        prompts = self.tokenizer.batch_decode(
            [q[q != pad_id] for q in queries], skip_special_tokens=True
        )
        texts = self.tokenizer.batch_decode(
            [r[r != pad_id] for r in responses], skip_special_tokens=True
        )
        scores = [reward(t, self.gold_of[p]) for p, t in zip(prompts, texts, strict=True)]
        self.seen.extend(scores)
        return torch.tensor(scores, dtype=torch.float32)


_get_reward = trl_ppo.get_reward


def get_reward(model, query_responses, pad_token_id, context_length):
    if isinstance(model, RuleReward):
        scores = model.score(query_responses, pad_token_id, context_length)
        return None, scores, None
    return _get_reward(model, query_responses, pad_token_id, context_length)


trl_ppo.get_reward = get_reward
GENERATE_SECONDS: list[float] = []  # per iteration: the rollouts' generate() calls
_batch_generation = trl_ppo.batch_generation


def batch_generation(*args, **kwargs):
    began = time.perf_counter()
    out = _batch_generation(*args, **kwargs)
    GENERATE_SECONDS.append(time.perf_counter() - began)
    return out


trl_ppo.batch_generation = batch_generation


class IterationTimer(TrainerCallback):
    """Seconds between the ends of consecutive PPO iterations (the first from train start)."""

    def __init__(self):
        self.seconds: list[float] = []
        self.last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job", help="the job's settings as JSON (default: strop's demo)")
    args = parser.parse_args()
    j = job(args.job)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    problems = read_problems(args.train)
    gold_of = {p["prompt"]: p["gold"] for p in problems}
    dataset = Dataset.from_dict(
        {"input_ids": [tokenizer(p["prompt"])["input_ids"] for p in problems]}
    )

    lora = dict(
        r=j["lora_rank"], lora_alpha=j["lora_alpha"], lora_dropout=0.0, target_modules=LORA_TARGETS
    )
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # The critic: a second copy of the base with its own LoRA and a score head (PEFT's
    # SEQ_CLS task trains the head too); the reference is the policy with its adapter off.
    value_model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=1, dtype=torch.float32
    )
    value_model.config.pad_token_id = tokenizer.pad_token_id
    value_model = get_peft_model(value_model, LoraConfig(task_type="SEQ_CLS", **lora))
    rule = RuleReward(tokenizer, gold_of)

    with tempfile.TemporaryDirectory() as out:
        config = PPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            logging_steps=10**9,
            disable_tqdm=True,
            seed=args.seed,
            bf16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            per_device_train_batch_size=j["rollouts"],
            gradient_accumulation_steps=1,
            local_rollout_forward_batch_size=j["rollouts"],
            num_mini_batches=j["rollouts"] // j["mini_batch"],
            num_ppo_epochs=j["epochs"],
            total_episodes=args.iterations * j["rollouts"],
            response_length=j["max_new_tokens"],
            temperature=j["temperature"],
            stop_token="eos",
            kl_coef=j["kl_coef"],
            gamma=j["gamma"],
            lam=j["lam"],
            cliprange=j["clip_low"],
            cliprange_value=j["value_clip"],
            vf_coef=j["value_loss_coef"],
            whiten_rewards=False,
            num_sample_generations=0,
            learning_rate=j["lr"],
            lr_scheduler_type="constant",
            weight_decay=j["weight_decay"],
            adam_beta1=j["betas"][0],
            adam_beta2=j["betas"][1],
            adam_epsilon=j["eps"],
            dataloader_num_workers=0,
        )
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=policy,
            ref_model=None,
            reward_model=rule,
            train_dataset=dataset,
            value_model=value_model,
            eval_dataset=dataset.select(range(8)),
            peft_config=LoraConfig(task_type="CAUSAL_LM", **lora),
        )
        # strop's two learning rates, actor and critic: TRL has one optimizer over both;
        # give it two parameter groups.
        wrapper = trainer.model
        actor_params = [p for p in wrapper.policy.parameters() if p.requires_grad]
        critic_params = [p for p in wrapper.value_model.parameters() if p.requires_grad]
        for group in trainer.optimizer.param_groups:
            group["params"].clear()
        trainer.optimizer.param_groups.clear()
        for params, lr in ((actor_params, j["lr"]), (critic_params, j["critic_lr"])):
            trainer.optimizer.add_param_group(
                {"params": params, "lr": lr, "initial_lr": lr, "weight_decay": j["weight_decay"]}
            )
        trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
        timer = IterationTimer()
        trainer.add_callback(timer)
        trainer.train()

    rewards = [
        sum(rule.seen[i : i + j["rollouts"]]) / j["rollouts"]
        for i in range(0, len(rule.seen), j["rollouts"])
    ]
    print_result(
        timer.seconds,
        reward=rewards,
        phases={"generate": statistics.median(GENERATE_SECONDS[1:] or GENERATE_SECONDS)},
        actor_trainable=sum(p.numel() for p in actor_params),
        critic_trainable=sum(p.numel() for p in critic_params),
        lrs=[group["lr"] for group in trainer.optimizer.param_groups],
        optimizer_steps=int(max(float(s["step"]) for s in trainer.optimizer.state.values())),
    )


if __name__ == "__main__":
    main()
