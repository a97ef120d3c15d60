"""``benchmarks/peers.py --distill``: ``strop distill`` against TRL 1.16's
``DistillationTrainer`` on the same on-policy distillation job: seconds per iteration.

The job, the same on both sides: the student is the shipped tiny-math model (a Qwen2
checkpoint, float32 on CPU) with a fresh LoRA r8/a16, dropout 0, on q, k, v, o, gate, up
and down (the demo recipe's); the teacher is tiny-math too, with the shipped teacher
adapter over it when this install has one (``strop.assets.tiny_math_teacher_path``) or the
one ``--teacher-adapter`` names (TRL gets that adapter merged into the base). Each
iteration samples 16 prompts x 4 completions of up to 48 new tokens at temperature 1 (no
top-k, no top-p) from the demo's synthetic GSM8K-style train split, and makes one AdamW
step (lr 1e-3, constant, weight decay 0.01, clip norm 1) over all 64 in 2 micro-batches of
32, on the generalized JSD with ``beta = 1``: the reverse KL(student || teacher) of the
full next-token distributions at every sampled token, token-mean over the 64, at
temperature 1. strop: ``strop distill`` (its code path, ``run_distill``) with the demo
recipe and ``distill.loss=jsd distill.beta=1`` (:data:`OVERRIDES`); TRL:
``DistillationConfig(beta=1, temperature=1)``, whose loss is that same divergence (TRL's
``generalized_jsd`` convention, which strop's ``distill.beta`` follows: docs/distill.md).

Why one optimizer step per iteration: TRL's trainer generates once per optimizer step
(the generation batch is ``per_device_train_batch_size x gradient_accumulation_steps``),
so strop's mini-batch is the whole 64 here (``ppo.mini_batch_size=64``), not the demo's 32.
The same prompts: TRL's trainer samples one completion per prompt, so :func:`write_prompts`
writes its prompt file from strop's own draw (``PromptSet.draw``: iteration ``k``'s 16
prompts, the texts strop formats), each 4 times in a row, read in file order
(``shuffle_dataset=False``): iteration ``k`` of both samples 4 completions of the same 16
prompts (with other random numbers: the completions differ).

Also run by default: ``strop-torch+distill.loss=reverse_kl``, strop's default loss (the
Thinking Machines recipe: the teacher's log-ratio of each sampled token as a PPO
advantage), the cheaper signal; TRL has no such loss, so it is reported against TRL's
only as what strop's default costs on the same job, not as a like-for-like pair.

The settings are strop's resolved config; TRL's script (``benchmarks/peers/trl_distill.py``)
gets them as ``--job`` JSON, and the list of differences is drawn from them.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

PEER = "trl-distill"
SCRIPT = "trl_distill.py"
VENV = "trl-grpo"  # TRL 1.16, the GRPO peer's venv: DistillationTrainer is in trl itself
REVERSE_KL = "strop-torch+distill.loss=reverse_kl"
SYSTEMS = ("strop-torch", PEER, REVERSE_KL)
PAIRS = (("strop-torch", PEER),)
ITERATIONS = 6  # --iterations' default: the first of each run is not counted
ROLLOUTS = 64  # one optimizer step over the iteration's 16 prompts x 4 completions
MICRO_BATCH = 32
OVERRIDES = [
    "ppo.advantage_estimator=grpo",  # critic-free: distill's requirement (no critic model)
    "distill.loss=jsd",
    "distill.beta=1",  # TRL's convention: the reverse KL(student || teacher)
    f"ppo.mini_batch_size={ROLLOUTS}",  # one optimizer step per generation, as TRL's
    f"ppo.micro_batch_size={MICRO_BATCH}",
]
PHASES = ("generate", "teacher", "train")


def tiny_math() -> Path:
    from strop.assets import tiny_math_path

    return Path(tiny_math_path())


def shipped_teacher_adapter() -> Path | None:
    """The teacher adapter shipped beside tiny-math, if this install has one."""
    from strop import assets
    from strop.errors import StropError

    find = getattr(assets, "tiny_math_teacher_path", None)
    try:
        return None if find is None else Path(find())
    except StropError:
        return None


def distill_config(data: Path, adapter: Path | None, overrides: list[str] | None = None):
    """strop's resolved ``demo`` recipe as this job runs it, with ``overrides``."""
    from strop.config import load_config

    teacher = [f"distill.teacher={tiny_math()}"]
    if adapter is not None:
        teacher.append(f"distill.teacher_adapter={adapter}")
    return load_config(
        "demo",
        [
            f"model.path={tiny_math()}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'validation.jsonl'}",
            *teacher,
            *OVERRIDES,
            *(overrides or []),
        ],
    )


def write_prompts(config, path: Path, iterations: int) -> Path:
    """TRL's prompts (JSONL ``{"prompt"}``) for ``iterations`` iterations: each iteration's
    prompts as strop draws them (the same file, reader, order and texts), each
    ``ppo.num_generations_per_prompt`` times in a row."""
    from strop.data.tokenizer import policy_tokenizer
    from strop.rl.prompts import PromptSet

    ppo = config.ppo
    train = PromptSet.read(config.data.train_path, config, policy_tokenizer(config))
    drawn = [
        i for step in range(iterations) for i in train.draw(step, ppo.prompts_per_step, config.seed)
    ]
    line = [json.dumps({"prompt": train.texts[i]}) for i in drawn]
    path.write_text(
        "".join(f"{text}\n" * ppo.num_generations_per_prompt for text in line), encoding="utf-8"
    )
    return path


def job_settings(config) -> dict:
    """The job as TRL's script takes it (``--job JSON``). TRL has one temperature, for
    sampling and the loss alike: strop's two must agree to hand it over."""
    from strop.errors import ConfigError
    from strop.io.peft import target_regex

    ppo, optim, lora, distill = config.ppo, config.optim, config.lora, config.distill
    if distill.temperature != config.generation.temperature:
        raise ConfigError(
            f"distill.temperature ({distill.temperature:g}) differs from "
            f"generation.temperature ({config.generation.temperature:g}): TRL has one"
        )
    micro = ppo.rows_per_micro_batch
    return {
        "micro_batch": micro,
        "accumulation": ppo.mini_batch_size // micro,
        "max_new_tokens": config.generation.max_new_tokens,
        "temperature": config.generation.temperature,
        "top_p": config.generation.top_p,
        "top_k": config.generation.top_k,
        "beta": distill.beta,
        "lora_rank": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "lora_targets": target_regex(lora.target_modules),
        "lr": optim.lr,
        "weight_decay": optim.weight_decay,
        "betas": [optim.b1, optim.b2],
        "eps": optim.eps,
        "max_grad_norm": optim.max_grad_norm,
        "teacher_adapter": distill.teacher_adapter,
    }


def describe(config) -> str:
    """strop's side of the job in one line."""
    ppo, optim, lora, distill, gen = (
        config.ppo, config.optim, config.lora, config.distill, config.generation,
    )  # fmt: skip
    teacher = tiny_math().name + (
        f" + adapter {distill.teacher_adapter}"
        if distill.teacher_adapter
        else " (the student's base)"
    )
    return (
        f"student {tiny_math().name} + LoRA r{lora.rank}/a{lora.alpha:g} dropout "
        f"{lora.dropout:g} on q,k,v,o,gate,up,down; teacher {teacher}; "
        f"{ppo.prompts_per_step} prompts x {ppo.num_generations_per_prompt} samples, <= "
        f"{gen.max_new_tokens} new tokens at temperature {gen.temperature:g} (top-k "
        f"{gen.top_k or 'off'}, top-p {gen.top_p:g}); loss distill.loss={distill.loss} "
        f"beta {distill.beta:g} temperature {distill.temperature:g} ({ppo.loss_aggregation}); "
        f"{ppo.prompts_per_step * ppo.num_generations_per_prompt // ppo.mini_batch_size} "
        f"optimizer step(s) of {ppo.mini_batch_size} in micro-batches of "
        f"{ppo.rows_per_micro_batch}, {ppo.ppo_epochs} epoch; AdamW lr {optim.lr:g} "
        f"({optim.schedule}), weight decay {optim.weight_decay:g}, clip norm "
        f"{optim.max_grad_norm}; float32, torch at 1 thread"
    )


def differences(config) -> list[str]:
    """How TRL's distillation job differs from strop's."""
    ppo, distill = config.ppo, config.distill
    out = [
        f"prompts: TRL samples one completion per prompt, so its dataset holds each of "
        f"strop's {ppo.prompts_per_step} prompts of an iteration {ppo.num_generations_per_prompt} "
        "times in a row (the same prompts per iteration; other random numbers, so other "
        "completions)",
        "generation: transformers generate() (dynamic KV cache) over the 64 prompts, "
        "left-padded to the batch's longest; strop's torch sampler (its own KV cache, each "
        "prompt's prefill shared by its samples)",
        "the teacher: TRL forwards it per micro-batch inside the loss, on the micro-batch's "
        "rows as padded; strop's jsd update does the same, on its packed rows",
        "the loss: both chunked over tokens from the models' final hidden states (TRL's "
        "ChunkedDivergenceFunction, its own backward; strop's torch checkpointing of each "
        f"{distill.chunk_tokens}-token chunk); TRL also logs the student's entropy per token",
        "the adapters' start: B zero on both (the student starts as the base); A drawn "
        "from other generators, so the runs part after step 1",
        "the step: Hugging Face Trainer's loop (accelerate, a DataLoader, its metrics "
        "gathered every step); strop's PPO loop (metrics.jsonl every step, no checkpoints "
        "here, no validation)",
    ]
    if distill.teacher_adapter:
        out.append(
            "the teacher adapter: merged into the teacher's base weights for TRL (a plain "
            "model, no LoRA matmuls); strop's teacher keeps it as an adapter over the base"
        )
    else:
        out.append(
            "the teacher is the student's base itself: with B = 0 the divergence starts at 0 "
            "on both sides and its gradient is 0 up to rounding (AdamW scales strop's "
            "rounding-level gradients up to small steps: its divergence drifts to about "
            "1e-4); the work per iteration is the same"
        )
    return out


def strop_child(
    backend: str, data: Path, run_dir: Path, iterations: int, seed: int, variant: str,
    adapter: Path | None,
) -> None:  # fmt: skip
    """Run ``strop distill`` (its code path, ``run_distill``) on the job; print RESULT:
    seconds per iteration, the phases' medians after the first, each iteration's
    divergence (``distill/jsd``, or ``distill/reverse_kl`` under that loss), mean response
    length and reward."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if backend == "torch":
        import torch

        torch.set_num_threads(1)
    from strop.distill.loop import run_distill

    config = distill_config(
        data,
        adapter,
        [f"run_dir={run_dir}", f"backend={backend}", f"seed={seed}", f"ppo.steps={iterations}",
         "ppo.validate_every=0", "checkpoint.every_steps=100000", "logging.tensorboard=false",
         *(variant.split(",") if variant else [])],
    )  # fmt: skip
    history = run_distill(config).history
    later = history[1:] or history
    metric = "distill/jsd" if config.distill.loss == "jsd" else "distill/reverse_kl"
    result = {
        "seconds": [r["timing/step"] for r in history],
        "reward": [r["train/reward"] for r in history],
        "divergence": [r[metric] for r in history],
        "length": [r["train/response_length"] for r in history],
        "phases": {  # jsd has no timing/teacher: its teacher runs inside the update
            phase: statistics.median(r[f"timing/{phase}"] for r in later)
            for phase in PHASES
            if f"timing/{phase}" in later[0]
        },
    }
    print("RESULT " + json.dumps(result), flush=True)


def job_lines(results: dict[str, list[dict]]) -> list[str]:
    """Per system, its first good run's divergence at the first and last iteration (the
    loss each side trained on: strop's ``distill/jsd``, TRL's logged loss; the same
    quantity when the jobs match, 0 while the teacher is the student's base), and the
    mean response length over all its runs' iterations (the work an iteration does)."""
    lines = []
    for system, runs in results.items():
        good = [r for r in runs if "error" not in r and r.get("divergence")]
        if good:
            first = good[0]["divergence"]
            lengths = [x for r in good for x in r.get("length", [])]
            mean = f"{statistics.mean(lengths):.1f}" if lengths else "-"
            lines.append(
                f"  {system}: divergence iteration 1 {first[0]:.5f}, iteration {len(first)} "
                f"{first[-1]:.5f}; mean response {mean} tokens"
            )
    return lines
