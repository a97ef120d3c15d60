"""A DPO step at a real model's shapes, on both backends, LoRA and full: what `strop dpo` runs.

Writes a random model with Qwen2.5-1.5B's shapes (``benchmarks/shapes.py``; nothing is
downloaded), then, in a fresh process per configuration (backend x LoRA/full, each with a
timeout, as ``benchmarks/mfu.py``), builds strop's policy (``build_policy``) and its
reference (``prepare_reference``: with LoRA the base with the adapters off, with full
fine-tuning a frozen copy of the weights) and times the DPO loop's own step
(:class:`strop.dpo.loop.DpoSteps`: the pairs laid out, the reference's forward, the
update) on ``--pairs`` random token pairs of ``--prompt`` prompt and ``--answer`` tokens a
answer. Reported per configuration: build s (policy and reference), the first step's s
(JAX compiles it), the median step ms over ``--steps`` after ``--warmup``, pairs/s, answer
tokens/s (both answers) and the device memory peak; as a table and, with ``--json``, a
file.

Run from the repository root (on a GPU; ``--shape small --device cpu`` checks it here)::

    python benchmarks/dpo_step.py [--shape qwen2.5-1.5b] [--pairs 8] [--prompt 256]
        [--answer 256] [--backends torch jax] [--modes lora full] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import child_result, cpu_name, print_table  # noqa: E402

_CHILD_ARGS = ("pairs", "prompt", "answer", "micro_batches", "steps", "warmup", "lora_rank",
               "dtype", "device")  # fmt: skip


def random_pairs(seed: int, count: int, prompt: int, answer: int, vocab: int):
    """``count`` (prompt, chosen, rejected) id lists, each prompt its own (nothing shared)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        tuple(rng.integers(3, vocab, n).tolist() for n in (prompt, answer, answer))
        for _ in range(count)
    ]


def device_peak_bytes(backend: str) -> int | None:
    from benchmarks.mfu import device_peak_bytes as peak

    try:
        return peak(backend)
    except Exception:  # a CPU device without memory stats
        return None


def measure(backend: str, lora: bool, args: argparse.Namespace) -> dict:
    """Runs in the child process: build the policy and its reference, time the steps."""
    from strop.backends import get_backend
    from strop.config import load_config
    from strop.data.batching import SftBatcher
    from strop.dpo.loop import DpoSteps
    from strop.io.model_spec import read_model_spec
    from strop.io.run_identity import CheckpointPlace, PolicyRun

    steps = args.warmup + args.steps
    config = load_config("dpo-lora-tiny", [
        f"backend={backend}", f"model.path={args.model}", f"model.dtype={args.dtype}",
        f"model.param_dtype={args.dtype}", f"lora.enabled={str(lora).lower()}",
        f"lora.rank={args.lora_rank}", f"lora.alpha={2 * args.lora_rank}",
        "lora.target_modules=[.*_proj]", "optim.lr=1e-6", "optim.warmup_steps=0",
        f"dpo.steps={steps}", f"dpo.batch_size={args.pairs}",
        f"dpo.micro_batch_size={args.pairs // args.micro_batches}",
        f"data.max_length={args.prompt + args.answer}", "mesh.fsdp=1", "mesh.data=1",
    ])  # fmt: skip
    vocab = read_model_spec(args.model).vocab_size
    pairs = random_pairs(0, args.pairs * steps, args.prompt, args.answer, vocab)
    order = SftBatcher(pairs, args.pairs, seed=0, shuffle=False, max_length=3)
    with tempfile.TemporaryDirectory() as checkpoints:
        began = time.perf_counter()
        policy = get_backend(backend).build_policy(
            config, PolicyRun(steps, CheckpointPlace.of(config, directory=checkpoints))
        )
        policy.prepare_reference()
        build_s = time.perf_counter() - began
        loop = DpoSteps(config, policy, order, 0)
        times, losses = [], []
        for step in range(steps):
            began = time.perf_counter()
            record = loop.step(step)  # host floats: the step is done
            times.append(time.perf_counter() - began)
            losses.append(record["dpo/loss"])
    later = times[args.warmup :] or times
    median = statistics.median(later)
    return {
        "build_s": build_s,
        "first_s": times[0],
        "median_s": median,
        "min_s": min(later),
        "max_s": max(later),
        "pairs_per_s": args.pairs / median,
        "answer_tokens_per_s": 2 * args.pairs * args.answer / median,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "device_peak": device_peak_bytes(backend),
    }


def run_child(args: argparse.Namespace, backend: str, mode: str) -> dict:
    """One configuration in a fresh process (:func:`benchmarks.report.child_result`)."""
    command = [sys.executable, __file__, "--model", args.model, "--child", backend, mode,
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in _CHILD_ARGS)]  # fmt: skip
    env = dict(os.environ)
    if args.device == "cpu":  # neither backend may pick up an accelerator
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    return child_result(command, args.timeout, env)


def device_name(device: str) -> str:
    if device == "cpu":
        return cpu_name()
    script = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    return done.stdout.strip() or "no GPU"


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="benchmarks/shapes.py SHAPES")
    parser.add_argument("--model", help="an existing checkpoint instead of a random --shape")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--pairs", type=int, default=8, help="pairs per step")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--answer", type=int, default=256, help="tokens of each answer")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--backends", nargs="+", default=["torch", "jax"])
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
    parser.add_argument("--json", help="also write every result to this file")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        backend, mode = args.child
        print(json.dumps(measure(backend, mode == "lora", args)))
        return

    model = args.model or f"random {args.shape}"
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from benchmarks.shapes import write_random_model

            began = time.perf_counter()
            args.model = str(write_random_model(Path(tmp) / "model", args.shape, args.dtype))
            print(f"wrote a random {args.shape} in {time.perf_counter() - began:.0f} s",
                  flush=True)  # fmt: skip
        results = {}
        for backend in args.backends:
            for mode in args.modes:
                name = f"{backend} {mode}"
                results[name] = run_child(args, backend, mode)
                print(f"{name}: {json.dumps(results[name])[:300]}", flush=True)

    print(f"\nDPO step (strop dpo's DpoSteps.step: layout, reference forward, update): "
          f"{args.pairs} pairs of {args.prompt} prompt + 2 x {args.answer} answer tokens "
          f"({args.micro_batches} micro-batch(es)), {args.dtype}, AdamW, LoRA r="
          f"{args.lora_rank} on every projection (reference: adapters off) or full "
          f"(reference: a frozen copy)")  # fmt: skip
    print(f"model:    {model}")
    print(f"date:     {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    print(f"machine:  {device_name(args.device)}; {cpu_name()} x{os.cpu_count()}; "
          f"Python {platform.python_version()}")  # fmt: skip
    print(f"command:  {' '.join([Path(sys.executable).name, *sys.argv])}\n")
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "failed: " + r["error"].splitlines()[-1][:100], *[""] * 6])
            continue
        rows.append([
            name, f"{r['build_s']:.1f}", f"{r['first_s']:.1f}",
            f"{r['median_s'] * 1e3:.0f} [{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}]",
            f"{r['pairs_per_s']:.2f}", f"{r['answer_tokens_per_s']:,.0f}",
            gib(r["device_peak"]), f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}",
        ])  # fmt: skip
    print_table(["config", "build s", "1st step s", "median ms [min-max]", "pairs/s",
                 "answer tokens/s", "device peak", "dpo/loss"], rows)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
