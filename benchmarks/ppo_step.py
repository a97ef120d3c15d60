"""Time per PPO iteration, split by phase, on both backends: the `strop ppo` code path.

Runs ``run_ppo`` (what ``strop ppo`` runs) with the ``ppo-lora-tiny`` recipe on a tiny
random Qwen2 with a tokenizer trained on GSM8K-style problems, once per backend, each in
its own subprocess (so each peak RSS is its own). Reported per backend: the median over
iterations after the first (which compiles on JAX) of each phase's seconds — generate,
reward, logprobs (old + reference), values, train_critic, train_policy — the whole step,
generated tokens/s, the first iteration's time and the peak resident memory; then the
torch/JAX ratio of each.

Run from the repository root::

    .venv/bin/python benchmarks/ppo_step.py [--steps 6] [--backends jax torch] [overrides...]

Extra ``key=value`` arguments override the recipe (e.g. ``ppo.prompts_per_step=16``).
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

PHASES = ("generate", "reward", "logprobs", "values", "train_critic", "train_policy", "step")


def make_task(root: Path) -> None:
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
            f"run_dir={root / ('run-' + backend)}",
            f"backend={backend}",
            f"ppo.steps={steps}",
            "ppo.validate_every=0",
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
    print("RESULT " + json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--backends", nargs="+", default=["jax", "torch"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.child:
        child(args.child, Path(args.root), args.steps, overrides)
        return

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_task(root)
        results = {}
        for backend in args.backends:
            command = [sys.executable, __file__, "--child", backend, "--root", str(root),
                       "--steps", str(args.steps), *overrides]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            results[backend] = json.loads(line.removeprefix("RESULT "))

    print(f"# PPO iteration by phase, ppo-lora-tiny recipe {' '.join(overrides)}".rstrip())
    print(f"# {datetime.date.today()}, {cpu_name()}, {platform.python_version()}, "
          f"median of {args.steps - 1} iterations after the first")  # fmt: skip
    headers = ["seconds", *args.backends]
    if set(args.backends) == {"jax", "torch"}:
        headers.append("torch/jax")
    rows = []
    for key in [*PHASES, "first_step", "tokens_per_s", "peak_rss_mib"]:
        row = [key] + [f"{results[b][key]:.3f}" for b in args.backends]
        if "torch/jax" in headers:
            jax_value = results["jax"][key]
            row.append(f"{results['torch'][key] / jax_value:.2f}x" if jax_value else "-")
        rows.append(row)
    print_table(headers, rows)


if __name__ == "__main__":
    main()
