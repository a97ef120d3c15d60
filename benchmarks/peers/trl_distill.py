"""TRL's on-policy distillation (``trl.DistillationTrainer``, trl 1.16) on strop's
``benchmarks/peers.py --distill`` job; run inside the TRL GRPO venv
(``benchmarks/.venvs/trl-grpo``).

Prints one ``RESULT {...}`` JSON line: the seconds of each iteration (one generation of
``micro_batch x accumulation`` completions, then one optimizer step over them; between the
ends of consecutive steps, the first from train start), each step's logged loss (the
divergence) and mean completion length, and the generation's median seconds.

TRL's settings for the job: the student a PEFT ``LoraConfig`` (rank, alpha, dropout and the
target regex strop's config gives) over the model, handed to the trainer as
``peft_config``; the teacher the same model, with ``teacher_adapter`` merged into it when
the job names one; ``beta`` and ``temperature`` strop's (``beta = 1``: the reverse
KL(student || teacher), TRL's ``generalized_jsd`` convention); the generation batch
``per_device_train_batch_size`` (strop's micro-batch) x ``gradient_accumulation_steps``
(strop's mini-batch / micro-batch) = the iteration's completions. The trainer samples one
completion per prompt, so ``--train`` holds each prompt once per completion, in a row,
read in file order (``shuffle_dataset=False``): ``benchmarks/peers_distill.py`` writes it
from strop's own draw, so each generation is the same problems x samples as strop's.
Float32 on CPU, one thread, no gradient checkpointing.

    benchmarks/.venvs/trl-grpo/bin/python benchmarks/peers/trl_distill.py \
        --model DIR --train prompts.jsonl --iterations 6 --job '{...}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from common import print_result
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DistillationConfig, DistillationTrainer

# strop's --distill job as benchmarks/peers_distill.py hands it over (--job overrides these)
DEFAULT_JOB = {
    "micro_batch": 32,
    "accumulation": 2,
    "max_new_tokens": 48,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "beta": 1.0,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "lora_dropout": 0.0,
    "lora_targets": r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    "lr": 1e-3,
    "weight_decay": 0.01,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "max_grad_norm": 1.0,
    "teacher_adapter": None,
}


class StepTimer(TrainerCallback):
    """Seconds between the ends of consecutive optimizer steps (the first from train start)."""

    def __init__(self):
        self.seconds: list[float] = []
        self.last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now


def load_teacher(model: str, adapter: str | None):
    """The frozen teacher: the model, with ``adapter`` merged into its weights if given."""
    teacher = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if adapter:
        teacher = PeftModel.from_pretrained(teacher, adapter).merge_and_unload()
    return teacher.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True, help="prompts JSONL, in generation order")
    parser.add_argument("--iterations", type=int, default=6, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job", help="the job's settings as JSON (default: strop's)")
    args = parser.parse_args()
    j = {**DEFAULT_JOB, **(json.loads(args.job) if args.job else {})}
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    with open(args.train, encoding="utf-8") as f:  # {"prompt"} lines, in generation order
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    dataset = Dataset.from_dict({"prompt": prompts})
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    student = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    teacher = load_teacher(args.model, j["teacher_adapter"])
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=j["lora_rank"],
        lora_alpha=j["lora_alpha"],
        lora_dropout=j["lora_dropout"],
        target_modules=j["lora_targets"],
        bias="none",
    )
    with tempfile.TemporaryDirectory() as out:
        config = DistillationConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=args.seed,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            per_device_train_batch_size=j["micro_batch"],
            gradient_accumulation_steps=j["accumulation"],
            max_steps=args.iterations,
            shuffle_dataset=False,
            dataloader_num_workers=0,
            max_completion_length=j["max_new_tokens"],
            temperature=j["temperature"],
            top_p=j["top_p"],
            top_k=j["top_k"] or 0,
            beta=j["beta"],
            learning_rate=j["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=j["weight_decay"],
            adam_beta1=j["betas"][0],
            adam_beta2=j["betas"][1],
            adam_epsilon=j["eps"],
            max_grad_norm=j["max_grad_norm"] or 0.0,
            log_completions=False,
        )
        trainer = DistillationTrainer(
            model=student,
            teacher_model=teacher,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora,
        )
        generate_seconds: list[float] = []
        generate = trainer._generate

        def timed_generate(*a, **kw):
            began = time.perf_counter()
            result = generate(*a, **kw)
            generate_seconds.append(time.perf_counter() - began)
            return result

        trainer._generate = timed_generate
        timer = StepTimer()
        trainer.add_callback(timer)
        trainer.train()

    logs = trainer.state.log_history
    losses = [r["loss"] for r in logs if "loss" in r]
    lengths = [r["completions/mean_length"] for r in logs if "completions/mean_length" in r]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print_result(
        timer.seconds,
        divergence=losses,
        length=lengths,
        phases={"generate": statistics.median(generate_seconds[1:] or generate_seconds)},
        generations=len(generate_seconds),
        trainable=trainable,
        optimizer_steps=int(max(float(s["step"]) for s in trainer.optimizer.state.values())),
    )


if __name__ == "__main__":
    main()
