"""TRL's GRPO (``trl.GRPOTrainer``, trl 1.16) on strop's demo job with GRPO advantages; run
inside the TRL GRPO venv.

Prints one ``RESULT {...}`` JSON line: seconds of each GRPO iteration (one iteration = one
generation of 16 prompts x 4 samples = 64 completions, then ``rollouts / mini_batch``
optimizer steps of ``mini_batch`` completions each), mean reward per iteration.

TRL's settings for that shape: ``per_device_train_batch_size = mini_batch`` (32),
``steps_per_generation = rollouts / mini_batch`` (2), so ``generation_batch_size`` is 64,
``num_generations = 4``, ``gradient_accumulation_steps = 1``. The reward is the gsm8k rule
reward (``common.reward``) as a TRL reward function.

    benchmarks/.venvs/trl-grpo/bin/python benchmarks/peers/trl_grpo.py \
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
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEEN: list[float] = []  # every completion's reward, in order


def gsm8k_reward(prompts, completions, gold, **kwargs) -> list[float]:
    scores = [reward(c, g) for c, g in zip(completions, gold, strict=True)]
    SEEN.extend(scores)
    return scores


class IterationTimer(TrainerCallback):
    """Seconds between the ends of consecutive iterations (``every`` optimizer steps each;
    the first from train start)."""

    def __init__(self, every: int):
        self.every = every
        self.seconds: list[float] = []
        self.last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
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
    steps_per_iteration = j["rollouts"] // j["mini_batch"]

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    problems = read_problems(args.train)
    dataset = Dataset.from_dict(
        {"prompt": [p["prompt"] for p in problems], "gold": [p["gold"] for p in problems]}
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=j["lora_rank"],
        lora_alpha=j["lora_alpha"],
        lora_dropout=0.0,
        target_modules=LORA_TARGETS,
    )

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            logging_steps=10**9,
            disable_tqdm=True,
            seed=args.seed,
            bf16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            per_device_train_batch_size=j["mini_batch"],
            gradient_accumulation_steps=1,
            steps_per_generation=steps_per_iteration,
            num_generations=j["samples"],
            num_iterations=j["epochs"],
            max_steps=args.iterations * steps_per_iteration * j["epochs"],
            max_completion_length=j["max_new_tokens"],
            temperature=j["temperature"],
            top_p=1.0,
            top_k=0,
            beta=j["kl_coef"],
            epsilon=j["clip_low"],
            epsilon_high=j["clip_high"],
            scale_rewards="group",
            loss_type="bnpo",  # token mean over each optimizer step's 32 (strop: token_mean)
            mask_truncated_completions=False,
            learning_rate=j["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=j["weight_decay"],
            adam_beta1=j["betas"][0],
            adam_beta2=j["betas"][1],
            adam_epsilon=j["eps"],
            max_grad_norm=j["max_grad_norm"] or 0.0,
            dataloader_num_workers=0,
            log_completions=False,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=gsm8k_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora,
        )
        generate_seconds: list[float] = []
        _generate = trainer._generate

        def timed_generate(*a, **kw):
            began = time.perf_counter()
            result = _generate(*a, **kw)
            generate_seconds.append(time.perf_counter() - began)
            return result

        trainer._generate = timed_generate
        timer = IterationTimer(steps_per_iteration * j["epochs"])
        trainer.add_callback(timer)
        trainer.train()

    per = j["rollouts"]
    rewards = [sum(SEEN[i : i + per]) / per for i in range(0, len(SEEN), per)]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print_result(
        timer.seconds,
        reward=rewards,
        phases={"generate": statistics.median(generate_seconds[1:] or generate_seconds)},
        generations=len(generate_seconds),
        trainable=trainable,
        optimizer_steps=int(max(float(s["step"]) for s in trainer.optimizer.state.values())),
    )


if __name__ == "__main__":
    main()
