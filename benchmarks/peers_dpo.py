"""``benchmarks/peers.py --dpo``: strop's ``strop dpo`` against TRL 1.16's ``DPOTrainer`` on
the same preference pairs, model, LoRA and batches: seconds per optimizer step.

The job is the ``dpo-lora-tiny`` recipe on the shipped tiny-math model (a Qwen2
checkpoint, float32 on CPU): sigmoid DPO, beta 0.1, the reference the base with the
adapters off; 8 pairs a step in 2 micro-batches of 4; AdamW lr 1e-3, constant, clip norm 1;
LoRA r8/a16, dropout 0, on every ``*_proj`` (the recipe's ``lm_head`` target is dropped:
TRL 1.16's fused LM head multiplies by ``lm_head.weight`` directly, so an adapter on
``lm_head`` would be in TRL's optimizer but never in its forward). :func:`write_pairs` writes
the pairs both read: synthetic GSM8K-style problems (:mod:`strop.data.synthetic`, the
demo's), the prompt the demo's ``Question: ...\\nAnswer:``, the chosen answer the worked
solution, the rejected one the same steps with the first step's result as the final
answer (with one step, or when that is the right one, the right one plus one). Both read
them in file order (strop ``data.shuffle=false``, TRL ``train_sampling_strategy=
"sequential"``), so step ``k`` of each trains on the same 8 pairs; ``data.max_length`` 128
holds every pair (no cut on either side). The settings are strop's resolved config; TRL's script
(``benchmarks/peers/trl_dpo.py``) gets them as ``--job`` JSON, and the list of differences
is drawn from them.

With fresh adapters the policy is its reference, so the first step's loss is log 2 on both
sides: printed as the check that the two jobs match.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from pathlib import Path

PEER = "trl-dpo"
SCRIPT = "trl_dpo.py"
VENV = "trl-grpo"  # TRL 1.16, the GRPO peer's venv (DPOTrainer needs nothing more)
SYSTEMS = ("strop-torch", PEER, "strop-jax")
PAIRS = (("strop-torch", PEER), ("strop-jax", PEER))
RECIPE = "dpo-lora-tiny"
N_PAIRS = 512
STEPS = 20  # optimizer steps per run (--iterations)
OVERRIDES = [
    'lora.target_modules=[".*_proj"]',  # no lm_head: TRL's fused head bypasses its adapter
    "data.max_length=128",  # every pair fits: nothing cut, nothing refused
    "data.shuffle=false",  # file order, as TRL's sequential sampler
]


def tiny_math() -> Path:
    from strop.assets import tiny_math_path

    return Path(tiny_math_path())


def write_pairs(path: Path, seed: int, count: int = N_PAIRS) -> Path:
    """``count`` text pairs ``{prompt, chosen, rejected}`` at ``path`` (JSONL)."""
    from strop.data.synthetic import make_problems

    template = "Question: {question}\nAnswer:"  # the demo's data.prompt_template
    lines = []
    for record in make_problems(count, seed):
        right = record["answer"]  # "a op b = r" lines, then "#### N"
        steps, final = right.rsplit("\n#### ", 1)
        first = steps.split("\n")[0].rsplit("= ", 1)[1]
        wrong = first if "\n" in steps and first != final else str(int(final) + 1)
        prompt = template.format(question=record["question"])
        chosen, rejected = f" {right}", f" {steps}\n#### {wrong}"
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def dpo_config(pairs: Path, overrides: list[str] | None = None):
    """strop's resolved ``dpo-lora-tiny`` with the benchmark's settings and ``overrides``."""
    from strop.config import load_config

    return load_config(
        RECIPE,
        [f"model.path={tiny_math()}", f"data.train_path={pairs}", *OVERRIDES, *(overrides or [])],
    )


def job_settings(config) -> dict:
    """The job as TRL's script takes it (``--job JSON``)."""
    from strop.io.peft import target_regex

    dpo, optim, lora = config.dpo, config.optim, config.lora
    return {
        "loss": dpo.loss,
        "beta": dpo.beta,
        "label_smoothing": dpo.label_smoothing,
        "batch_size": dpo.batch_size,
        "micro_batch_size": dpo.micro_batch_size,
        "max_length": config.data.max_length,
        "lora_rank": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "lora_targets": target_regex(lora.target_modules),
        "lr": optim.lr,
        "schedule": optim.schedule,
        "warmup_steps": optim.warmup_steps,
        "weight_decay": optim.weight_decay,
        "betas": [optim.b1, optim.b2],
        "eps": optim.eps,
        "max_grad_norm": optim.max_grad_norm,
        "logging_steps": config.logging.every_steps,
    }


def describe(config) -> str:
    """strop's side of the job in one line."""
    dpo, optim, lora = config.dpo, config.optim, config.lora
    return (
        f"{RECIPE}: {dpo.loss} loss, beta {dpo.beta:g}, reference: {dpo.reference} (adapters "
        f"off); {dpo.batch_size} pairs a step in {dpo.batch_size // dpo.micro_batch_size} "
        f"micro-batches of {dpo.micro_batch_size}; LoRA r{lora.rank}/a{lora.alpha:g} dropout "
        f"{lora.dropout:g} on {', '.join(lora.target_modules)} (not the recipe's lm_head: "
        f"TRL's fused LM head skips an adapter there); AdamW lr {optim.lr:g} "
        f"({optim.schedule}, warmup {optim.warmup_steps}), weight decay "
        f"{optim.weight_decay:g}, clip norm {optim.max_grad_norm}; max length "
        f"{config.data.max_length}; model {tiny_math().name} in {config.model.dtype}; "
        f"metrics logged every {config.logging.every_steps} step(s); pairs in file order"
    )


def differences(config) -> list[str]:
    """How TRL's DPO job differs from strop's."""
    dpo = config.dpo
    micro = dpo.micro_batch_size
    return [
        f"the forward: TRL runs each micro-batch as {2 * micro} rows (prompt + chosen, then "
        "prompt + rejected), right-padded to the longest, the prompt twice per pair; strop "
        "packs each pair's prompt once with both answers after it (lay_out_pairs: segments "
        "that see the prompt and not each other) in rows twice max_length wide",
        f"the reference: TRL forwards each micro-batch with the adapters off right before its "
        f"update ({dpo.batch_size // micro} no-grad forwards a step); strop forwards the "
        "step's micro-batches with the adapters off first, then the updates (the same forwards)",
        "the LM head: TRL's fused head (chunks over the positions, log-probs only, plus "
        "entropy, mean logit and top-1 per token for its logs); strop's model gives the "
        "logits, the core takes their log-softmax at the answer tokens",
        "the adapters' start: B zero and A uniform in +-1/sqrt(in) on both (PEFT's "
        "kaiming_uniform(a=sqrt(5))), so step 1 is log 2 on both; strop draws A as a function "
        "of (seed, module path), TRL from torch's generator after manual_seed(seed): other "
        "draws, so the losses part slightly after step 1",
        "tokenization: TRL tokenizes prompt + answer + EOS text together and splits where "
        "the prompt's tokens end; strop tokenizes the prompt and the answer apart (then EOS): "
        "the answer-token counts of step 1 are printed below to compare",
        "the step: Hugging Face Trainer's loop (accelerate, a DataLoader and DPO's collator, "
        "its metrics gathered every logging step); strop's job loop (metrics.jsonl every "
        "logging step; checkpoints off here on both)",
        "strop-jax only: its rows keep all their columns (twice max_length) and bucketed row "
        "counts, one compiled program per shape (the steps that compile are the outliers of "
        "its first steps, and of a later step that brings a new shape); XLA's thread pool "
        "rather than one thread",
    ]


def strop_child(backend: str, pairs: Path, run_dir: Path, steps: int, seed: int, variant: str):
    """Run ``strop dpo`` (its code path, ``run_dpo``) on ``pairs``; print RESULT: the
    seconds between the ends of consecutive steps (the first from the start of step 1;
    wall-clock and this process's CPU time), each step's ``dpo/loss``, the median time
    inside a step (``timing/step_s``) and step 1's answer tokens."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if backend == "torch":
        import torch

        torch.set_num_threads(1)
    from strop.dpo import loop
    from strop.metrics.sinks import read_metrics

    ends: list[tuple[float, float]] = []  # (wall-clock, this process's CPU time)
    step = loop.DpoSteps.step

    def timed(self, index: int):
        if not ends:
            ends.append((time.perf_counter(), time.process_time()))
        record = step(self, index)
        ends.append((time.perf_counter(), time.process_time()))
        return record

    loop.DpoSteps.step = timed
    config = dpo_config(
        pairs,
        [f"run_dir={run_dir}", f"backend={backend}", f"seed={seed}", f"dpo.steps={steps}",
         "checkpoint.every_steps=100000", "logging.tensorboard=false",
         *(variant.split(",") if variant else [])],
    )  # fmt: skip
    loop.run_dpo(config)
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "dpo/loss" in r]
    inner = [r["timing/step_s"] for r in records]
    result = {
        "seconds": [b[0] - a[0] for a, b in itertools.pairwise(ends)],
        "cpu": [b[1] - a[1] for a, b in itertools.pairwise(ends)],
        "loss": [r["dpo/loss"] for r in records],
        "in_step": statistics.median(inner[1:] or inner),
        "tokens": records[0]["train/tokens"],
    }
    print("RESULT " + json.dumps(result), flush=True)


def cpu_lines(results: dict[str, list[dict]]) -> list[str]:
    """Per system, the median CPU seconds per step after the first (this process's, all
    its threads: what a busy machine's other processes disturb least; JAX's XLA pool runs
    several threads) and the whole run's steps in wall-clock seconds, first steps and
    compiles included (mean over runs); then the ratios strop/TRL of the CPU medians."""
    medians, lines = {}, []
    for system, runs in results.items():
        good = [r for r in runs if "error" not in r]
        later = [x for r in good for x in r.get("cpu", [])[1:]]
        if later:
            medians[system] = statistics.median(later)
            steps = len(good[0]["seconds"])
            total = statistics.mean(sum(r["seconds"]) for r in good)
            lines.append(
                f"  {system}: {medians[system]:.3f} CPU s/step; all {steps} steps "
                f"{total:.1f} s wall"
            )
    for ours, theirs in PAIRS:
        if ours in medians and theirs in medians:
            lines.append(f"  {ours}/{theirs}: {medians[ours] / medians[theirs]:.2f}x (CPU time)")
    return lines


def first_step_lines(results: dict[str, list[dict]]) -> list[str]:
    """Per system: step 1's loss (log 2 when the two jobs match), its answer tokens, and
    the last step's loss, from each system's first good run."""
    lines = []
    for system, runs in results.items():
        good = [r for r in runs if "error" not in r and r.get("loss")]
        if good:
            run = good[0]
            off = run["loss"][0] - math.log(2.0)
            lines.append(
                f"  {system}: step 1 loss {run['loss'][0]:.6f} (log 2 {off:+.1e}), "
                f"{run.get('tokens', float('nan')):.0f} answer tokens; step "
                f"{len(run['loss'])} loss {run['loss'][-1]:.4f}"
            )
    return lines
