"""torch's CPU threads on a shared machine: OpenMP wait policies and thread counts.

Runs the torch backend's PPO iteration (``benchmarks/ppo_step.py``'s task and child, the
demo's shapes) under four OpenMP settings — OpenMP's defaults (torch imported before
anything else), ``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT=10000``, and
``OMP_NUM_THREADS=1`` — each on an idle machine and beside one busy process (a Python
spin loop, as a second job on the machine would be), each in its own process. Without
``OMP_NUM_THREADS`` torch uses the threads strop picks (the usable cores). Prints the
median seconds per iteration after the first, per round, and the ratio to the first row.

Run from the repository root (nothing else running)::

    .venv/bin/python benchmarks/cpu_threads.py [--steps 6] [--rounds 2] [overrides...]
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.report import cpu_name, print_table  # noqa: E402

DEMO_SHAPES = [
    "ppo.prompts_per_step=16", "ppo.num_generations_per_prompt=4", "ppo.mini_batch_size=32",
    "generation.max_new_tokens=48", "ppo.kl_coef=0.0",
]  # fmt: skip
SETTINGS = [  # (name, environment, torch imported before strop (OpenMP default wait), busy?)
    ("OpenMP default", {}, True, False),
    ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}, False, False),
    ("GOMP_SPINCOUNT=10000", {"GOMP_SPINCOUNT": "10000"}, True, False),
    ("OMP_NUM_THREADS=1", {"OMP_NUM_THREADS": "1"}, True, False),
    ("OpenMP default, 1 busy process", {}, True, True),
    ("OMP_WAIT_POLICY=PASSIVE, 1 busy process", {"OMP_WAIT_POLICY": "PASSIVE"}, False, True),
    ("GOMP_SPINCOUNT=10000, 1 busy process", {"GOMP_SPINCOUNT": "10000"}, True, True),
    ("OMP_NUM_THREADS=1, 1 busy process", {"OMP_NUM_THREADS": "1"}, True, True),
]


def run_child(
    root: Path, steps: int, environment: dict[str, str], openmp_default: bool, overrides: list[str]
) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(environment)
    overrides = [*overrides, f"run_dir={tempfile.mkdtemp(dir=root)}"]  # a fresh run each
    command = [sys.executable, __file__, "--child", "--root", str(root), "--steps", str(steps)]
    if openmp_default:
        command.append("--openmp-default")
    done = subprocess.run([*command, *overrides], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--openmp-default", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.child:
        if args.openmp_default:
            import torch  # noqa: F401  (OpenMP initialised before strop can set its policy)
        from benchmarks.ppo_step import child

        child("torch", Path(args.root), args.steps, [*DEMO_SHAPES, *overrides])
        return

    from benchmarks.ppo_step import make_task

    seconds: dict[str, list[float]] = {name: [] for name, *_ in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_task(root)
        for _ in range(args.rounds):
            for name, environment, openmp_default, busy in SETTINGS:
                neighbour = (
                    subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                )
                try:
                    seconds[name].append(
                        run_child(root, args.steps, environment, openmp_default, overrides)
                    )
                finally:
                    if neighbour is not None:
                        neighbour.kill()
                        neighbour.wait()

    print("# torch PPO iteration (demo shapes) by OpenMP setting and machine load")
    print(f"# {datetime.date.today()}, {cpu_name()}, {len(os.sched_getaffinity(0))} usable "
          f"cores, Python {platform.python_version()}; each: median s/iteration of "
          f"{args.steps - 1} after the first, per round")  # fmt: skip
    base = statistics.median(seconds[SETTINGS[0][0]])
    rows = [
        [name, " ".join(f"{s:.3f}" for s in values), f"{statistics.median(values):.3f}",
         f"{statistics.median(values) / base:.2f}x"]
        for name, values in seconds.items()
    ]  # fmt: skip
    print_table(["setting", "rounds (s)", "median (s)", "vs first"], rows)


if __name__ == "__main__":
    main()
