"""TRL's multi-turn GRPO (``trl.GRPOTrainer`` with ``tools=``, trl 1.16) on the calculator
task of ``benchmarks/peers.py --agent``; run inside the TRL GRPO venv.

The episodes are TRL's own tool-calling loop: the prompt is the calculator environment's
system prompt and the question (a conversational dataset), rendered by the model's chat
template with the tool's schema (``tools=[calculate]``); each turn is one
``generate()`` over every episode still calling tools (prompt, earlier turns and tool
results concatenated as token ids, re-prefilled); a turn's ``<tool_call>`` is parsed with
TRL's Qwen ``response_template`` (the tiny model's template is not one TRL knows, so it
is set on the tokenizer by hand, as TRL's error message says to), the tool is called and
its result appended, until a turn has no call or ``max_tool_calling_iterations`` more
turns (``max_turns - 1``) have been played. The tool and the score are strop's own
(``strop.agents.calculator.calculate`` and ``correct``, imported from ``--strop-src``:
strop's core is pure Python), so both sides call the same function and score the same way.

Prints one ``RESULT {...}`` JSON line: seconds of each GRPO iteration (one generation of
``rollouts`` episodes, then ``rollouts / mini_batch`` optimizer steps), mean reward per
iteration, mean model turns and tool calls per episode per iteration.

    benchmarks/.venvs/trl-grpo/bin/python benchmarks/peers/trl_grpo_agent.py \
        --model DIR --train train.jsonl --strop-src src --iterations 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from common import job, print_result
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEEN: list[float] = []  # every episode's reward, in order
TURNS: list[int] = []  # every episode's assistant turns, in order
CALLS: list[int] = []  # every episode's tool calls (parsed ones), in order


def read_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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
    parser.add_argument("--strop-src", required=True, help="strop's src/ (for the tool and score)")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job", help="the job's settings as JSON (see benchmarks/peers.py)")
    args = parser.parse_args()
    sys.path.insert(0, args.strop_src)
    from strop.agents.calculator import SYSTEM_PROMPT, calculate, correct

    j = job(args.job)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    steps_per_iteration = j["rollouts"] // j["mini_batch"]

    def correct_reward(prompts, completions, answer, **kwargs) -> list[float]:
        scores = []
        for prompt, completion, gold in zip(prompts, completions, answer, strict=True):
            messages = list(prompt) + list(completion)
            scores.append(correct({"answer": gold}, messages)["correct"])
            assistant = [m for m in completion if m.get("role") == "assistant"]
            TURNS.append(len(assistant))
            CALLS.append(sum(len(m.get("tool_calls") or []) for m in assistant))
        SEEN.extend(scores)
        return scores

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    # The Qwen (hermes) <tool_call> parser: the tiny model's template writes calls as
    # Qwen2.5's does, but TRL's add_response_schema only knows templates by their text.
    tokenizer.response_template = qwen3_template
    records = read_records(args.train)
    dataset = Dataset.from_dict(
        {
            "prompt": [
                [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": r["question"]},
                ]
                for r in records
            ],
            "answer": [r["answer"] for r in records],
        }
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
            # the whole episode after the prompt (turns and tool results); one turn is
            # capped at max_new_tokens by generation_kwargs, as strop caps each turn
            max_completion_length=j["max_completion_tokens"],
            generation_kwargs={"max_new_tokens": j["max_new_tokens"]},
            max_tool_calling_iterations=j["max_turns"] - 1,
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
            reward_funcs=correct_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora,
            tools=[calculate],
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
    turns = [sum(TURNS[i : i + per]) / per for i in range(0, len(TURNS), per)]
    tool_calls = [sum(CALLS[i : i + per]) / per for i in range(0, len(CALLS), per)]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print_result(
        timer.seconds,
        reward=rewards,
        turns=turns,
        tool_calls=tool_calls,
        phases={"generate": statistics.median(generate_seconds[1:] or generate_seconds)},
        generations=len(generate_seconds),
        trainable=trainable,
        optimizer_steps=int(max(float(s["step"]) for s in trainer.optimizer.state.values())),
    )


if __name__ == "__main__":
    main()
