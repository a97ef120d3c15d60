"""Time per PPO iteration, split by phase, on both backends: the `strop ppo` code path.

Runs ``run_ppo`` (what ``strop ppo`` runs) with the ``ppo-lora-tiny`` recipe on a tiny
random Qwen2 with a tokenizer trained on GSM8K-style problems, once per backend, each in
its own subprocess (so each peak RSS is its own). Reported per backend: the median over
iterations after the first (which compiles on JAX) of each phase's seconds — generate,
reward, logprobs (old + reference), values, train (critic and policy updates) — the whole step,
generated tokens/s, the first iteration's time and the peak resident memory; then the
torch/JAX ratio of each.

Run from the repository root::

    .venv/bin/python benchmarks/ppo_step.py [--steps 6] [--backends jax torch] [overrides...]

Extra ``key=value`` arguments override the recipe (e.g. ``ppo.prompts_per_step=16``).
``--shape qwen2.5-1.5b`` gives the task's model Qwen2.5-1.5B's body and vocabulary
(random weights, ``benchmarks/shapes.py``) for a run on an accelerator; ``--task DIR``
keeps the task (train set and model) in DIR, and reuses it when it is there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import cpu_name, print_table  # noqa: E402

PHASES = ("generate", "reward", "logprobs", "values", "train", "step")


def make_task(root: Path, shape: str | None = None) -> None:
    import numpy as np

    from strop.io.tiny import make_tiny_checkpoint

    rng = np.random.default_rng(0)
    texts = []
    with (root / "train.jsonl").open("w") as f:
        for _ in range(256):
            a, b = (int(x) for x in rng.integers(0, 100, 2))
            question = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
            answer = f"{a} + {b} = {a + b}\n#### {a + b}"
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
            texts.append(f"Question: {question}\nAnswer: {answer}")
    make_tiny_checkpoint(root / "model", texts, seed=0)
    if shape:
        from benchmarks.shapes import reshape_checkpoint

        reshape_checkpoint(root / "model", shape)


def child(backend: str, root: Path, steps: int, overrides: list[str]) -> None:
    """Run the PPO loop and print one JSON line of timings."""
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from strop.config import load_config
    from strop.rl.ppo import run_ppo

    config = load_config(
        "ppo-lora-tiny",
        [
            f"model.path={root / 'model'}",
            f"data.train_path={root / 'train.jsonl'}",
            f"run_dir={tempfile.mkdtemp(prefix=f'run-{backend}-', dir=root)}",  # fresh: no resume
            f"backend={backend}",
            f"ppo.steps={steps}",
            "ppo.validate_every=0",
            "generation.max_new_tokens=24",  # the recipe's until 2026-11-27, as benchmarked
            "checkpoint.every_steps=1000",
            "logging.tensorboard=false",
            *overrides,
        ],
    )
    history = run_ppo(config).history
    later = history[1:]
    out = {
        phase: statistics.median(r.get(f"timing/{phase}", 0.0) for r in later) for phase in PHASES
    }
    out["tokens_per_s"] = statistics.median(r["throughput/tokens_per_s"] for r in later)
    out["first_step"] = history[0]["timing/step"]
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from benchmarks.mfu import device_peak_bytes

    peak = device_peak_bytes(backend)
    if peak is not None:
        out["device_peak_gib"] = peak / 2**30
    print("RESULT " + json.dumps(out))


def accelerator() -> str:
    """The GPU's name, or "no GPU" (asked of torch in a child, so that no CUDA context
    stays open in this process)."""
    script = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    return done.stdout.strip() or "no GPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--backends", nargs="*", default=["jax", "torch"],
                        help="none: only write the task (with --task)")  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help="benchmarks/shapes.py SHAPES (default: the tiny model)")
    parser.add_argument("--task", help="keep the task in this directory (reused if there)")
    args, overrides = parser.parse_known_args()
    if args.child:
        child(args.child, Path(args.root), args.steps, overrides)
        return

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.task or tmp)
        if not (root / "model" / "config.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            make_task(root, args.shape)
        results = {}
        for backend in args.backends:
            command = [sys.executable, __file__, "--child", backend, "--root", str(root),
                       "--steps", str(args.steps), *overrides]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:  # say why, and still report the other backend
                print(f"{backend} failed:\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
                continue
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            results[backend] = json.loads(line.removeprefix("RESULT "))
            print(f"{backend}: {line}", flush=True)
        if not args.backends:
            print(f"task ready in {root}")
            return
        if not results:
            sys.exit("every backend failed")

    print(f"# PPO iteration by phase, ppo-lora-tiny recipe, model {args.shape or 'tiny'} "
          f"{' '.join(overrides)}".rstrip())  # fmt: skip
    print(f"# {datetime.date.today()}, {cpu_name()}, {accelerator()}, Python "
          f"{platform.python_version()}, median of {args.steps - 1} iterations after the first")  # fmt: skip
    backends = list(results)
    headers = ["seconds", *backends]
    if set(backends) == {"jax", "torch"}:
        headers.append("torch/jax")
    rows = []
    keys = [*PHASES, "first_step", "tokens_per_s", "peak_rss_mib", "device_peak_gib"]
    for key in [k for k in keys if all(k in results[b] for b in backends)]:
        row = [key] + [f"{results[b][key]:.3f}" for b in backends]
        if "torch/jax" in headers:
            jax_value = results["jax"][key]
            row.append(f"{results['torch'][key] / jax_value:.2f}x" if jax_value else "-")
        rows.append(row)
    print_table(headers, rows)


if __name__ == "__main__":
    main()
