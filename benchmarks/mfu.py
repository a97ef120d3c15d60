"""Training-step MFU at a real model's shapes, on both backends: the update `strop sft` runs.

Builds a random model with Qwen2.5-1.5B's shapes (``benchmarks/shapes.py``; nothing is
downloaded), then, in a fresh process per configuration (backend x LoRA/full), builds
strop's policy (``get_backend(b).build_policy``, what ``strop sft`` builds) in the given
dtype and times ``train_step`` on ``batch x length`` tokens of random ids: median step time
after the warm-up steps (the first compiles on JAX), tokens/s, the step's useful FLOPs and
the model FLOPs utilisation (MFU) against the chip's dense peak and against a large matrix
product measured on the same machine. Each process's device memory peak is its own.

FLOPs are counted as ``benchmarks/ppo_flops.py`` counts them (the convention of PaLM and
torchtitan, with causal attention over ``(n + 1) / 2`` tokens on average, and LoRA's
terms): a full fine-tune does 3x its forward (6N per token plus attention), a LoRA step
about 2x (no weight gradients for the frozen base). A LoRA step's MFU therefore counts only
the work a LoRA step needs; its TFLOP/s are comparable with the full step's.

Run from the repository root (on a GPU machine; ``--shape small`` checks it on a CPU)::

    python benchmarks/mfu.py [--shape qwen2.5-1.5b] [--batch 8] [--length 1024]
        [--backends torch jax] [--modes lora full] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import child_result, cpu_name, print_table  # noqa: E402

# Dense bf16 peak of the chips a run may land on (vendor datasheets, without sparsity).
DATASHEET_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def step_flops(model_dir: str, config, tokens: int, length: int) -> float:
    """Useful FLOPs of one training step over ``tokens`` tokens in rows of ``length``."""
    from benchmarks.ppo_flops import adapted_projections, forward_flops, training_flops

    from strop.io.model_spec import read_model_spec

    spec = read_model_spec(model_dir)
    lora = config.lora
    forward = forward_flops(spec, tokens, (length + 1) / 2, spec.vocab_size,
                            lora.rank if lora.enabled else 0, adapted_projections(spec, lora))  # fmt: skip
    return training_flops(forward, adapters_only=lora.enabled)


def make_batch(step: int, rows: int, length: int, vocab: int) -> dict:
    """Full rows of random ids (no padding), every token but the first a target."""
    import numpy as np

    ids = np.random.default_rng(step).integers(0, vocab, (rows, length))
    loss_mask = np.ones((rows, length), np.float32)
    loss_mask[:, 0] = 0
    return {"input_ids": ids, "attention_mask": np.ones((rows, length), np.int32),
            "loss_mask": loss_mask}  # fmt: skip


def device_peak_bytes(backend: str) -> int | None:
    if backend == "torch":
        import torch

        return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def measure(backend: str, lora: bool, args: argparse.Namespace) -> dict:
    """Runs in the child process: build the policy, warm up, time ``args.steps`` steps."""
    from strop.backends import get_backend
    from strop.config import load_config
    from strop.io.model_spec import read_model_spec
    from strop.io.run_identity import CheckpointPlace, PolicyRun

    config = load_config("tiny", [
        f"backend={backend}", f"model.path={args.model}", f"model.dtype={args.dtype}",
        f"model.param_dtype={args.dtype}", f"lora.enabled={str(lora).lower()}",
        f"lora.rank={args.lora_rank}", f"lora.alpha={2 * args.lora_rank}", "optim.lr=1e-5",
        "optim.warmup_steps=0", "mesh.fsdp=1", "mesh.data=1",
    ])  # fmt: skip
    vocab = read_model_spec(args.model).vocab_size
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as checkpoints:
        policy = get_backend(backend).build_policy(
            config,
            PolicyRun(args.steps + args.warmup, CheckpointPlace.of(config, directory=checkpoints)),
        )
        build_s = time.perf_counter() - began
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            batch = make_batch(step, args.batch, args.length, vocab)
            began = time.perf_counter()
            metrics = policy.train_step(batch, micro_batches=args.micro_batches)  # host floats
            times.append(time.perf_counter() - began)
            losses.append(metrics["loss"])
    later = times[args.warmup :]
    return {
        "build_s": build_s,
        "first_s": times[0],
        "median_s": statistics.median(later),
        "min_s": min(later),
        "max_s": max(later),
        "tokens": args.batch * args.length,
        "flops": step_flops(args.model, config, args.batch * args.length, args.length),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "device_peak": device_peak_bytes(backend),
    }


def matmul_ceiling() -> dict:
    """Runs in a child: the best TFLOP/s of a large product in the benchmark's dtype (bf16
    8192^3 on a GPU, float32 2048^3 on a CPU), timed with device events on a GPU."""
    import torch

    cuda = torch.cuda.is_available()
    n, dtype = (8192, torch.bfloat16) if cuda else (2048, torch.float32)
    device = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(5):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                a @ b
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / 10
        else:
            began = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - began
        best = min(best, seconds)
    name = torch.cuda.get_device_name() if cuda else cpu_name()
    return {"tflops": 2 * n**3 / best / 1e12, "shape": f"{n}^3 {str(dtype)[6:]}", "device": name,
            "versions": versions()}  # fmt: skip


def versions() -> str:
    from importlib.metadata import version

    names = ("torch", "transformers", "peft", "jax", "jaxlib", "flax", "qwix", "optax")
    found = []
    for name in names:
        try:
            found.append(f"{name} {version(name)}")
        except Exception:
            found.append(f"{name} -")
    return ", ".join(found)


def run_child(args: argparse.Namespace, *child: str) -> dict:
    """One configuration in a fresh process (:func:`benchmarks.report.child_result`)."""
    command = [sys.executable, __file__, "--model", args.model, "--child", *child,
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("batch", "length", "micro_batches", "steps", "warmup", "lora_rank",
                          "dtype"))]  # fmt: skip
    return child_result(command, args.timeout)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", help="benchmarks/shapes.py SHAPES")
    parser.add_argument("--model", help="an existing checkpoint instead of a random --shape")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--backends", nargs="+", default=["torch", "jax"])
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--timeout", type=int, default=300, help="seconds per configuration")
    parser.add_argument("--json", help="also write every result to this file")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "matmul":
            print(json.dumps(matmul_ceiling()))
        else:
            backend, mode = args.child
            print(json.dumps(measure(backend, mode == "lora", args)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from benchmarks.shapes import write_random_model

            began = time.perf_counter()
            args.model = str(write_random_model(Path(tmp) / "model", args.shape, args.dtype))
            print(f"wrote a random {args.shape} in {time.perf_counter() - began:.0f} s",
                  flush=True)  # fmt: skip
        from strop.io.model_spec import read_model_spec

        spec = read_model_spec(args.model)  # before a temporary model goes
        ceiling = run_child(args, "matmul")
        results = {}
        for backend in args.backends:
            for mode in args.modes:
                results[f"{backend} {mode}"] = run_child(args, backend, mode)
                print(f"{backend} {mode}: {json.dumps(results[f'{backend} {mode}'])[:300]}",
                      flush=True)  # fmt: skip

    device = ceiling.get("device", "?")
    peak = next((v for k, v in DATASHEET_TFLOPS.items() if k in device), None)
    print(f"\nTraining-step MFU: batch {args.batch} x length {args.length} "
          f"({args.micro_batches} micro-batch(es)), {args.dtype} weights and compute, "
          f"AdamW, LoRA r={args.lora_rank} on all seven projections")  # fmt: skip
    print(f"model:    random, hidden {spec.hidden_size}, {spec.num_layers} layers, "
          f"{spec.num_heads}/{spec.num_kv_heads} heads of {spec.head_dim}, MLP "
          f"{spec.intermediate_size}, vocabulary {spec.vocab_size}")  # fmt: skip
    print(f"date:     {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    print(f"machine:  {device}; {cpu_name()} x{os.cpu_count()}; Python {platform.python_version()}")
    print(f"versions: {ceiling.get('versions', '?')}")
    print(f"ceiling:  {ceiling.get('tflops', float('nan')):.0f} TFLOP/s measured "
          f"({ceiling.get('shape', '?')} matmul, torch); datasheet dense bf16: "
          f"{peak or '-'} TFLOP/s")  # fmt: skip
    print(f"command:  {' '.join([Path(sys.executable).name, *sys.argv])}\n")
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "failed: " + r["error"].splitlines()[-1][:100], *[""] * 9])
            continue
        rate = r["flops"] / r["median_s"] / 1e12
        rows.append([
            name, f"{r['build_s']:.0f}", f"{r['first_s']:.1f}",
            f"{r['median_s'] * 1e3:.0f} [{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}]",
            f"{r['tokens'] / r['median_s']:,.0f}", f"{r['flops'] / 1e12:.1f}", f"{rate:.0f}",
            f"{rate / peak:.1%}" if peak else "-", f"{rate / ceiling['tflops']:.1%}"
            if "tflops" in ceiling else "-", gib(r["device_peak"]),
            f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}",
        ])  # fmt: skip
    print_table(["config", "build s", "1st step s", "median ms [min-max]", "tokens/s",
                 "TFLOP/step", "TFLOP/s", "MFU (datasheet)", "of matmul", "device peak",
                 "loss"], rows)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"ceiling": ceiling, "results": results}, indent=1))


if __name__ == "__main__":
    main()
