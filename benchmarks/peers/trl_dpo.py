"""TRL's DPO (``trl.DPOTrainer``, trl 1.16) on strop's ``dpo-lora-tiny`` job; run inside
the TRL GRPO venv (``benchmarks/.venvs/trl-grpo``).

Prints one ``RESULT {...}`` JSON line: the seconds of each optimizer step (between the ends
of consecutive steps, the first from train start; wall-clock and this process's CPU
time), each step's logged loss, and step 1's
answer tokens (the chosen and rejected completions of its pairs, EOS included).

TRL's settings for the job: a PEFT ``LoraConfig`` (rank, alpha, dropout and the target
regex strop's config gives; PEFT matches it with ``re.fullmatch`` on module paths, as
strop does) handed to the trainer as ``peft_config``, no ``ref_model``: TRL's reference
is then the model with the adapters disabled; ``per_device_train_batch_size`` = strop's
micro-batch, ``gradient_accumulation_steps`` = batch / micro-batch; the pairs in file
order (``train_sampling_strategy="sequential"``); float32 on CPU, one thread.

    benchmarks/.venvs/trl-grpo/bin/python benchmarks/peers/trl_dpo.py \
        --model DIR --train pairs.jsonl --iterations 20 --job '{...}'
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from common import print_result
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

# strop's dpo-lora-tiny as benchmarks/peers_dpo.py hands it over (--job overrides these)
DEFAULT_JOB = {
    "loss": "sigmoid",
    "beta": 0.1,
    "label_smoothing": 0.0,
    "batch_size": 8,
    "micro_batch_size": 4,
    "max_length": 128,
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "lora_dropout": 0.0,
    "lora_targets": ".*_proj",
    "lr": 1e-3,
    "schedule": "constant",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "max_grad_norm": 1.0,
    "logging_steps": 1,
}


class StepTimer(TrainerCallback):
    """Seconds between the ends of consecutive optimizer steps (the first from train start):
    wall-clock, and the CPU time of this process (all its threads)."""

    def __init__(self):
        self.seconds: list[float] = []
        self.cpu: list[float] = []
        self.last = (0.0, 0.0)

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        now = (time.perf_counter(), time.process_time())
        self.seconds.append(now[0] - self.last[0])
        self.cpu.append(now[1] - self.last[1])
        self.last = now


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--train", required=True, help="prompt/chosen/rejected JSONL")
    parser.add_argument("--iterations", type=int, default=20, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--job", help="the job's settings as JSON (default: dpo-lora-tiny's)")
    args = parser.parse_args()
    j = {**DEFAULT_JOB, **(json.loads(args.job) if args.job else {})}
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    accumulation = j["batch_size"] // j["micro_batch_size"]

    with open(args.train, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    dataset = Dataset.from_list(records)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=j["lora_rank"],
        lora_alpha=j["lora_alpha"],
        lora_dropout=j["lora_dropout"],
        target_modules=j["lora_targets"],
        bias="none",
    )
    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            logging_steps=j["logging_steps"],
            disable_tqdm=True,
            seed=args.seed,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            per_device_train_batch_size=j["micro_batch_size"],
            gradient_accumulation_steps=accumulation,
            max_steps=args.iterations,
            train_sampling_strategy="sequential",
            dataloader_num_workers=0,
            max_length=j["max_length"],
            loss_type=[j["loss"]],
            beta=j["beta"],
            label_smoothing=j["label_smoothing"],
            precompute_ref_log_probs=False,
            learning_rate=j["lr"],
            lr_scheduler_type=(
                "constant_with_warmup"
                if j["schedule"] == "constant" and j["warmup_steps"]
                else j["schedule"]
            ),
            warmup_steps=j["warmup_steps"],
            weight_decay=j["weight_decay"],
            adam_beta1=j["betas"][0],
            adam_beta2=j["betas"][1],
            adam_epsilon=j["eps"],
            max_grad_norm=j["max_grad_norm"] or 0.0,
        )
        trainer = DPOTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=lora,
        )
        first = trainer.train_dataset.select(range(j["batch_size"]))  # file order
        tokens = sum(len(x) for x in first["chosen_ids"]) + sum(
            len(x) for x in first["rejected_ids"]
        )
        timer = StepTimer()
        trainer.add_callback(timer)
        trainer.train()

    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print_result(
        timer.seconds,
        cpu=timer.cpu,
        loss=losses,
        tokens=tokens,
        trainable=trainable,
        optimizer_steps=int(max(float(s["step"]) for s in trainer.optimizer.state.values())),
    )


if __name__ == "__main__":
    main()
