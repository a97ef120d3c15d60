"""SFT step time and peak memory: torch vs JAX backend, and LoRA vs full on each.

Every configuration trains the same random Qwen2 (built with ``transformers``) on the
same batches through the public policy API (``get_backend(b).build_policy``), the code
``strop sft`` runs. Each runs in its own fresh subprocess so that its peak memory is its
own: peak resident set size (``ru_maxrss``) on CPU, plus the device allocator's peak on
an accelerator. Reported: median step time after 2 warm-up steps (the first compiles on
JAX), tokens/s, the first step's time, peak memory, and the ratios torch/JAX and
full/LoRA.

Run from the repository root::

    .venv/bin/python benchmarks/sft_backends.py [--steps 10] [--batch 8] [--length 128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.lora_vs_full import BENCH_MODEL, make_batch  # noqa: E402
from benchmarks.report import cpu_name, print_table  # noqa: E402

WARMUP_STEPS = 2
CONFIGS = [("jax", True), ("torch", True), ("jax", False), ("torch", False)]


def measure(backend: str, lora: bool, model_dir: str, args: argparse.Namespace) -> dict:
    """Runs inside the child process: build, warm up, time ``args.steps`` steps."""
    from strop.backends import get_backend
    from strop.config import load_config
    from strop.io.run_identity import CheckpointPlace, PolicyRun

    config = load_config(
        "tiny",
        [
            f"backend={backend}",
            f"model.path={model_dir}",
            f"lora.enabled={str(lora).lower()}",
            "lora.rank=8",
            "lora.alpha=16",
            "optim.lr=1e-4",
            "optim.warmup_steps=0",
            "mesh.fsdp=1",
            "mesh.data=1",
        ],
    )
    with tempfile.TemporaryDirectory() as checkpoints:
        policy = get_backend(backend).build_policy(
            config,
            PolicyRun(args.steps + WARMUP_STEPS, CheckpointPlace.of(config, directory=checkpoints)),
        )
        times, losses = [], []
        for step in range(WARMUP_STEPS + args.steps):
            batch = make_batch(step, args.batch, args.length, BENCH_MODEL["vocab_size"])
            began = time.perf_counter()
            metrics = policy.train_step(batch, micro_batches=1)  # returns host floats: synced
            times.append(time.perf_counter() - began)
            losses.append(metrics["loss"])
        tokens = metrics["tokens"]
    device_peak = None
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            device_peak = torch.cuda.max_memory_allocated()
    else:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        device_peak = stats.get("peak_bytes_in_use")
    return {
        "first_s": times[0],
        "median_s": statistics.median(times[WARMUP_STEPS:]),
        "min_s": min(times[WARMUP_STEPS:]),
        "max_s": max(times[WARMUP_STEPS:]),
        "tokens": tokens,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device_peak": device_peak,
    }


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--child", nargs=3, metavar=("BACKEND", "LORA", "MODEL_DIR"))
    args = parser.parse_args()
    if args.child:
        backend, lora, model_dir = args.child
        print(json.dumps(measure(backend, lora == "1", model_dir, args)))
        return

    import jax
    import torch
    from tests.tiny_models import save_tiny_model

    print("SFT step: torch vs JAX backend, LoRA vs full (strop policies)")
    print(f"date:      {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"machine:   {cpu_name()} ({platform.machine()}), os.cpu_count()={os.cpu_count()}")
    print(f"devices:   jax {jax.devices()}, torch cuda={torch.cuda.is_available()}")
    print(f"versions:  jax {jax.__version__}, torch {torch.__version__}")
    print(f"model:     random Qwen2 {BENCH_MODEL}")
    print(
        f"run:       batch {args.batch} x length {args.length}, AdamW, float32, one device, "
        f"median of {args.steps} steps after {WARMUP_STEPS} warm-up steps; each config in "
        "a fresh process"
    )
    print()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_tiny_model("qwen2", Path(tmp) / "model", **BENCH_MODEL))
        for backend, lora in CONFIGS:
            command = [
                sys.executable, __file__, "--steps", str(args.steps), "--batch",
                str(args.batch), "--length", str(args.length),
                "--child", backend, "1" if lora else "0", model_dir,
            ]  # fmt: skip
            env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0:
                sys.exit(f"{backend} lora={lora} failed:\n{done.stderr[-3000:]}")
            results[backend, lora] = json.loads(done.stdout.strip().splitlines()[-1])

    rows = []
    for (backend, lora), r in results.items():
        rows.append(
            [
                f"{backend} {'LoRA r=8' if lora else 'full'}",
                f"{r['first_s']:.2f}",
                f"{r['median_s'] * 1e3:.1f} [{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}]",
                f"{r['tokens'] / r['median_s']:,.0f}",
                mib(r["peak_rss"]),
                mib(r["device_peak"]),
                f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}",
            ]
        )
    print_table(
        ["config", "1st step s", "median step ms [min-max]", "tokens/s", "peak RSS",
         "peak device", "loss first -> last"],
        rows,
    )  # fmt: skip
    print()
    for lora in (True, False):
        j, t = results["jax", lora], results["torch", lora]
        print(
            f"torch/JAX ({'LoRA' if lora else 'full'}): step time {t['median_s'] / j['median_s']:.2f}x, "
            f"peak RSS {t['peak_rss'] / j['peak_rss']:.2f}x"
        )
    for backend in ("jax", "torch"):
        full, lora = results[backend, False], results[backend, True]
        print(
            f"full/LoRA ({backend}): step time {full['median_s'] / lora['median_s']:.2f}x, "
            f"peak RSS {full['peak_rss'] / lora['peak_rss']:.2f}x"
        )


if __name__ == "__main__":
    main()
