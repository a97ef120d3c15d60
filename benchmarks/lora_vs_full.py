"""LoRA vs full fine-tuning with the JAX backend: step time, trainable params, optimizer bytes.

What it measures, and prints as tables (no assertions):

1. On one small random Qwen2 model (built with ``transformers``, saved to a temp dir and
   loaded with ``strop.load_model`` on a one-device mesh), in the same process: LoRA
   (rank 8, alpha 16, default targets) vs full fine-tuning with AdamW. For each: the
   median wall time of ``Trainer.step`` over ``--steps`` steps after 2 warm-up steps
   (the first one compiles; warm-up is excluded), the first (compiling) step's time,
   the trainable parameter count and the optimizer-state bytes (sum of ``nbytes`` of
   ``trainer.opt_state`` leaves), plus the full/LoRA ratios. The two
   trainers' timed steps are interleaved so that machine noise hits both alike.
2. Qwen2.5-1.5B shapes without any weights: the model (and its LoRA r=8 adapters) is
   built under ``nnx.eval_shape`` and the AdamW state under ``jax.eval_shape``, giving
   total params, trainable params and optimizer-state bytes for LoRA vs full.

Run from the repository root (CPU by default; set JAX_PLATFORMS to use another backend)::

    .venv/bin/python benchmarks/lora_vs_full.py [--steps 10] [--batch 8] [--length 128]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained's shard bar
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.tiny_models

import flax
import jax
import numpy as np
from benchmarks.report import cpu_name, print_table
from flax import nnx
from tests.tiny_models import QWEN25_CONFIG, save_tiny_model

import strop
from strop.backends.jax.lora import apply_lora, dense_modules, trainable_filter
from strop.backends.jax.model import CausalLM
from strop.backends.jax.sharding import make_mesh
from strop.backends.jax.train import Trainer, make_optimizer
from strop.config import LoraConfig, OptimConfig
from strop.models import parse_config

LORA = LoraConfig(enabled=True, rank=8, alpha=16)
WARMUP_STEPS = 2

# Small enough for a 2-core CPU, big enough that the step is not pure overhead.
BENCH_MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1024,
    "vocab_size": 2048,
}


def leaf_count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def leaf_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def header() -> None:
    print("LoRA vs full fine-tuning (strop, JAX backend)")
    print(f"date:      {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(
        f"machine:   {cpu_name()} ({platform.machine()}), os.cpu_count()={os.cpu_count()}, "
        f"{platform.system()} {platform.release()}"
    )
    print(f"devices:   {jax.devices()}")
    print(
        f"versions:  python {platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}"
    )
    print()


def make_batch(step: int, rows: int, length: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    attention_mask = np.ones((rows, length), np.int32)
    attention_mask[::2, -length // 8 :] = 0  # some right padding
    loss_mask = attention_mask.astype(np.float32)
    loss_mask[:, : length // 4] = 0  # a "prompt" that is not trained on
    ids = rng.integers(0, vocab, (rows, length))
    return {"input_ids": ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def build_trainer(model_dir: Path, lora: bool):
    mesh = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    handle = strop.load_model(model_dir, mesh=mesh)
    model = apply_lora(handle.model, LORA, seed=0) if lora else handle.model
    trainable = trainable_filter(lora)
    trainer = Trainer(
        model, handle.mesh, OptimConfig(lr=1e-4), total_steps=100, trainable=trainable
    )
    return model, trainer, trainable


def bench_tiny(steps: int, batch: int, length: int) -> None:
    vocab = BENCH_MODEL["vocab_size"]
    print(
        f"[1] step time on a random Qwen2 ({', '.join(f'{k}={v}' for k, v in BENCH_MODEL.items())})"
    )
    print(
        f"    batch {batch} x length {length}, micro_batches 1, AdamW lr 1e-4, float32; "
        f"median of {steps} steps after {WARMUP_STEPS} warm-up steps"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model("qwen2", Path(tmp), **BENCH_MODEL)
        setups = {
            "LoRA r=8": build_trainer(model_dir, True),
            "full": build_trainer(model_dir, False),
        }

    batches = [make_batch(i, batch, length, vocab) for i in range(WARMUP_STEPS + steps)]
    times: dict[str, list[float]] = {name: [] for name in setups}
    losses: dict[str, list[float]] = {name: [] for name in setups}
    for data in batches:  # interleaved: a LoRA step, then a full step, on the same batch
        for name, (_, trainer, _) in setups.items():
            start = time.perf_counter()
            metrics = trainer.step(data, 1)  # returns host floats: already synchronised
            times[name].append(time.perf_counter() - start)
            losses[name].append(metrics["loss"])

    results = {}
    for name, (model, trainer, trainable) in setups.items():
        timed = times[name][WARMUP_STEPS:]
        results[name] = {
            "total": leaf_count(nnx.state(model, nnx.Param)),
            "trainable": leaf_count(nnx.state(model, trainable)),
            "opt_bytes": sum(x.nbytes for x in jax.tree.leaves(trainer.opt_state)),
            "median": statistics.median(timed),
            "min": min(timed),
            "max": max(timed),
            "first": times[name][0],
            "compiles": trainer.traces.count,
            "loss": (losses[name][0], losses[name][-1]),
        }
    tokens = batch * length
    rows = [
        [
            name,
            f"{r['total']:,}",
            f"{r['trainable']:,}",
            f"{r['opt_bytes']:,} ({human_bytes(r['opt_bytes'])})",
            f"{r['first']:.2f}",
            f"{r['median'] * 1e3:.1f} [{r['min'] * 1e3:.0f}-{r['max'] * 1e3:.0f}]",
            f"{tokens / r['median']:,.0f}",
            str(r["compiles"]),
            f"{r['loss'][0]:.4f} -> {r['loss'][1]:.4f}",
        ]
        for name, r in results.items()
    ]
    print()
    print_table(
        [
            "",
            "params (incl. adapters)",
            "trainable",
            "optimizer state bytes",
            "1st step s",
            "median step ms [min-max]",
            "tokens/s",
            "compiles",
            "loss first -> last",
        ],
        rows,
    )
    lora, full = results["LoRA r=8"], results["full"]
    print()
    print(
        f"ratio full/LoRA: step time {full['median'] / lora['median']:.2f}x, "
        f"optimizer bytes {full['opt_bytes'] / lora['opt_bytes']:.1f}x, "
        f"trainable params {full['trainable'] / lora['trainable']:.1f}x"
    )
    print()


def bench_qwen25_shapes() -> None:
    print("[2] Qwen2.5-1.5B shapes, no weights (nnx.eval_shape / jax.eval_shape), float32 params")
    spec = parse_config(QWEN25_CONFIG)
    start = time.perf_counter()
    base = nnx.eval_shape(lambda: CausalLM(spec, rngs=nnx.Rngs(0)))
    lora_model = nnx.eval_shape(
        lambda: apply_lora(CausalLM(spec, rngs=nnx.Rngs(0)), LORA, seed=0)
    )  # qwix runs the model once on a dummy token; that works under eval_shape
    build_s = time.perf_counter() - start

    # Cross-check the adapters qwix created against rank * (in + out) per targeted Dense.
    analytic = sum(
        LORA.rank * (math.prod(m.in_shape) + math.prod(m.out_shape))
        for m in dense_modules(lora_model).values()
        if hasattr(m, "kernel_lora_a")
    )
    optimizer = make_optimizer(OptimConfig(), 100)
    results = {}
    for name, model, trainable in (
        ("LoRA r=8", lora_model, trainable_filter(True)),
        ("full", base, trainable_filter(False)),
    ):
        params = nnx.state(model, trainable)
        opt_state = jax.eval_shape(optimizer.init, params)
        results[name] = {
            "total": leaf_count(nnx.state(model, nnx.Param)),
            "trainable": leaf_count(params),
            "opt_bytes": leaf_bytes(opt_state),
        }
    targeted = sum(hasattr(m, "kernel_lora_a") for m in dense_modules(lora_model).values())
    print(
        f"    layers={spec.num_layers} hidden={spec.hidden_size} heads={spec.num_heads}/"
        f"{spec.num_kv_heads} intermediate={QWEN25_CONFIG['intermediate_size']} "
        f"vocab={spec.vocab_size} tied={spec.tie_word_embeddings}; "
        f"LoRA on {targeted} Dense modules (default targets), built in {build_s:.1f} s"
    )
    lora_trainable = results["LoRA r=8"]["trainable"]
    print(
        f"    LoRA params from qwix under eval_shape: {lora_trainable:,}; "
        f"analytic sum of rank*(in+out): {analytic:,} "
        f"({'match' if analytic == lora_trainable else 'MISMATCH'})"
    )
    print()
    print_table(
        ["", "params (incl. adapters)", "trainable", "AdamW state bytes"],
        [
            [
                name,
                f"{r['total']:,}",
                f"{r['trainable']:,}",
                f"{r['opt_bytes']:,} ({human_bytes(r['opt_bytes'])})",
            ]
            for name, r in results.items()
        ],
    )
    lora, full = results["LoRA r=8"], results["full"]
    print()
    print(
        f"ratio full/LoRA: optimizer bytes {full['opt_bytes'] / lora['opt_bytes']:.1f}x, "
        f"trainable params {full['trainable'] / lora['trainable']:.1f}x "
        f"(LoRA trains {100 * lora['trainable'] / full['trainable']:.2f}% of the base params)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per setup")
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--length", type=int, default=128, help="tokens per row")
    args = parser.parse_args()
    header()
    bench_tiny(args.steps, args.batch, args.length)
    bench_qwen25_shapes()


if __name__ == "__main__":
    main()
