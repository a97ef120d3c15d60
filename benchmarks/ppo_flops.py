"""How much arithmetic a PPO iteration does, and how fast this machine can do it.

Reads a finished `strop ppo` / `strop demo` run (its ``config.yaml``, ``metrics.jsonl``
and train prompts) and prints, per phase, the useful floating-point work of one iteration
(matmuls and attention of every real token; padding is not counted), the measured seconds
(median over the iterations after the first), the achieved GFLOP/s, and the share of what
this machine's matrix multiply reaches (measured here, on the backend and thread count the
run used). The sum gives a floor: the seconds an iteration would take if every phase ran
at the speed of one large matrix multiply.

Run from the repository root, e.g. on the demo's run::

    .venv/bin/strop demo backend=torch run_dir=/tmp/demo-torch
    .venv/bin/python benchmarks/ppo_flops.py /tmp/demo-torch [--threads 1]

Counting (the convention of PaLM's and torchtitan's MFU, with LoRA's own terms):
a forward costs 2 FLOPs per multiply-add of every projection, the LM head (or the value
head) and attention (``QK^T`` and ``PV`` over the causal context, ``(n + 1) / 2`` tokens
on average for a sequence of ``n``); a LoRA adapter adds ``2 r (in + out)`` per projection
and token. A backward costs the forward again for the input gradients, and again for the
weight gradients of what trains (only the adapters with LoRA; every weight without);
attention's backward is twice its forward.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import cpu_name, print_table  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def projection_shapes(spec) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of each projection of one decoder layer."""
    e, h, k, d, m = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                     spec.intermediate_size)  # fmt: skip
    return {"q_proj": (e, h * d), "k_proj": (e, k * d), "v_proj": (e, k * d),
            "o_proj": (h * d, e), "gate_proj": (e, m), "up_proj": (e, m), "down_proj": (m, e)}  # fmt: skip


def forward_flops(spec, tokens: float, context: float, head_out: int, lora_rank: int,
                  lora_targets: dict[str, int]) -> tuple[float, float, float]:  # fmt: skip
    """``(dense, attention, adapters)`` FLOPs of a forward over ``tokens`` tokens that each
    attend to ``context`` tokens on average; ``head_out`` is the vocabulary (LM head) or 1
    (value); ``lora_targets``: projection name -> layers that carry an adapter on it."""
    shapes = projection_shapes(spec)
    dense = sum(i * o for i, o in shapes.values()) * spec.num_layers + spec.hidden_size * head_out
    attention = 2 * spec.num_heads * spec.head_dim * context * spec.num_layers
    adapters = sum(lora_rank * (i + o) * lora_targets.get(n, 0) for n, (i, o) in shapes.items())
    return 2 * tokens * dense, 2 * tokens * attention, 2 * tokens * adapters


def training_flops(forward: tuple[float, float, float], *, adapters_only: bool) -> float:
    """A training step's FLOPs from its forward's ``(dense, attention, adapters)``: the
    forward, the input gradients (attention's twice), and the weight gradients of what
    trains (only the adapters with LoRA; every weight without)."""
    dense, attention, adapters = forward
    weights = adapters if adapters_only else dense + adapters
    return dense + attention + adapters + (dense + adapters + 2 * attention) + weights


def adapted_projections(spec, lora) -> dict[str, int]:
    """Projection name -> how many layers ``lora.target_modules`` puts an adapter on (the
    patterns matched against HF module paths, as strop's backends match them)."""
    from strop.lora_targets import match_targets

    if not lora.enabled:
        return {}
    paths = [f"model.layers.{layer}.{'mlp' if name in MLP else 'self_attn'}.{name}"
             for layer in range(spec.num_layers) for name in PROJECTIONS]  # fmt: skip
    matched = match_targets(list(lora.target_modules), paths)
    return {name: sum(path.endswith("." + name) for path in matched) for name in PROJECTIONS}


def phase_flops(spec, config, tokens: float, context: float) -> dict[str, float]:
    """Useful FLOPs of one iteration's phases, ``tokens`` real tokens in the batch."""
    ppo, lora = config.ppo, config.lora
    rank, targets = (lora.rank if lora.enabled else 0), adapted_projections(spec, lora)
    lm = forward_flops(spec, tokens, context, spec.vocab_size, rank, targets)
    value = forward_flops(spec, tokens, context, 1, rank, targets)

    def update(forward: tuple[float, float, float]) -> float:
        return ppo.ppo_epochs * training_flops(forward, adapters_only=lora.enabled)

    flops = {"generate": sum(lm)}
    forwards = (ppo.old_logprobs != "sampler") + bool(ppo.reference_forward)
    if forwards:
        flops["logprobs"] = forwards * sum(lm)
    if ppo.has_critic:
        flops["values"] = sum(value)
    # timing/train: the critic's and the policy's updates together
    flops["train"] = update(lm) + (update(value) if ppo.has_critic else 0.0)
    return flops


def matmul_gflops(backend: str, threads: int | None, m: int, k: int, n: int) -> float:
    """Best of a few timed ``[m, k] x [k, n]`` float32 products on ``backend``."""
    if backend == "torch":
        import torch

        if threads:
            torch.set_num_threads(threads)
        a, b = torch.randn(m, k), torch.randn(k, n)

        def run():
            return a @ b
    else:
        import jax
        import jax.numpy as jnp

        a = jax.random.normal(jax.random.key(0), (m, k))
        b = jax.random.normal(jax.random.key(1), (k, n))
        product = jax.jit(jnp.matmul)

        def run():
            return product(a, b).block_until_ready()

    run()
    best = float("inf")
    for _ in range(5):
        began, count = time.perf_counter(), 0
        while time.perf_counter() - began < 0.3:
            run()
            count += 1
        best = min(best, (time.perf_counter() - began) / count)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a finished strop ppo/demo run directory")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for the roofline (default: torch's own choice)")  # fmt: skip
    args = parser.parse_args()

    from strop import rewards
    from strop.config import load_config
    from strop.data import Tokenizer
    from strop.io.model_spec import read_model_spec
    from strop.metrics.sinks import read_metrics
    from strop.rl.prompts import PromptSet

    config = load_config(args.run_dir / "config.yaml")
    spec = read_model_spec(config.model.path)
    tokenizer = Tokenizer.from_pretrained(config.model.path)
    reward = rewards.resolve(config.ppo.reward, setting="ppo.reward")
    prompts = PromptSet.read(config.data.train_path, config, tokenizer, reward=reward)
    records = [r for r in read_metrics(args.run_dir / "metrics.jsonl") if "timing/step" in r]
    later = records[1:] or records  # the first iteration compiles (JAX)
    prompt_tokens = statistics.fmean(len(ids) for ids in prompts.ids)
    response_tokens = statistics.fmean(r["train/response_length"] for r in later)
    rows = config.ppo.prompts_per_step * config.ppo.num_generations_per_prompt
    length = prompt_tokens + response_tokens
    flops = phase_flops(spec, config, rows * length, (length + 1) / 2)

    backend = config.backend
    e, m = spec.hidden_size, spec.intermediate_size
    peak = matmul_gflops(backend, args.threads, 2048, 2048, 2048)
    at_shape = matmul_gflops(backend, args.threads, int(config.ppo.mini_batch_size * length), e, m)

    print("PPO iteration: useful FLOPs by phase against this machine's matrix multiply")
    print(f"date:      {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    print(f"machine:   {cpu_name()}, os.cpu_count()={os.cpu_count()}")
    print(f"command:   {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"run:       {args.run_dir} ({backend}, {len(records)} iterations, {config.model.path})")
    print(f"job:       {rows} rows of {prompt_tokens:.1f} prompt + {response_tokens:.1f} response "
          f"tokens (means); lora {'r' + str(config.lora.rank) if config.lora.enabled else 'off'}; "
          f"epochs {config.ppo.ppo_epochs}; old log-probs {config.ppo.old_logprobs}")  # fmt: skip
    print(f"matmul:    {peak:.1f} GFLOP/s at 2048^3, {at_shape:.1f} GFLOP/s at "
          f"[{int(config.ppo.mini_batch_size * length)}, {e}] x [{e}, {m}] (a mini-batch's MLP "
          f"projection), {backend}, threads: {args.threads or 'default'}")  # fmt: skip
    print()
    table, total_s, total_flops = [], 0.0, 0.0
    for phase, work in flops.items():
        seconds = statistics.median(r.get(f"timing/{phase}", 0.0) for r in later)
        total_s, total_flops = total_s + seconds, total_flops + work
        rate = work / seconds / 1e9 if seconds else float("nan")
        table.append([phase, f"{work / 1e9:.2f}", f"{seconds:.3f}", f"{rate:.1f}",
                      f"{rate / peak:.0%}", f"{work / 1e9 / peak:.3f}"])  # fmt: skip
    step_s = statistics.median(r["timing/step"] for r in later)
    table.append(["phases", f"{total_flops / 1e9:.2f}", f"{total_s:.3f}",
                  f"{total_flops / total_s / 1e9:.1f}", f"{total_flops / total_s / 1e9 / peak:.0%}",
                  f"{total_flops / 1e9 / peak:.3f}"])  # fmt: skip
    print_table(["phase", "GFLOP", "median s", "GFLOP/s", "of 2048^3", "floor s"], table)
    print(f"\nwhole iteration: {step_s:.3f} s median; floor at the 2048^3 rate: "
          f"{total_flops / 1e9 / peak:.3f} s, at the mini-batch MLP shape's rate: "
          f"{total_flops / 1e9 / at_shape:.3f} s")  # fmt: skip


if __name__ == "__main__":
    main()
