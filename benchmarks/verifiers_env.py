"""A verifiers 0.4 environment end to end (``env.name=verifiers:<module>``), beside the
built-in ``calculator`` on the same problems.

The verifiers environment is tests/verifiers_calc.py (a taskset written with verifiers'
classes: the calculator's system prompt, one ``calculate`` tool, rewards ``correct`` and
``used_tool``). Measured, on the shipped tiny-calc model (CPU):

* ``import verifiers.v1`` in a fresh process, and loading the taskset (strop's preflight);
* one episode's environment calls without a model (``reset``, a step running one tool
  call, the final step with the scoring), per episode, for each environment;
* ``strop ppo`` for ``--iterations`` iterations (GRPO, ``--prompts`` x ``--group``
  episodes each) with each environment: the run's wall time, the median ``timing/step``
  and ``timing/generate`` (the episodes, environment included) after the first iteration,
  and the reward and tool-call metrics (the same seed: the same problems and samples).
  A one-iteration run first takes the backend's first-run costs out of both.

Run from the repository root (the verifiers extra installed)::

    python benchmarks/verifiers_env.py --backend torch --iterations 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.verifiers_calc

from strop.agents.calculator import SYSTEM_PROMPT
from strop.agents.calculator_tasks import calc_splits
from strop.agents.environment import load_environment
from strop.assets import tiny_calc_path
from strop.config import load_config
from strop.metrics.sinks import read_metrics
from strop.rl.ppo import run_ppo

VERIFIERS = "verifiers:tests.verifiers_calc"
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "23 * 41"}}\n</tool_call>'


def import_seconds() -> float:
    code = (
        "import time; t = time.perf_counter(); import verifiers.v1; print(time.perf_counter() - t)"
    )
    return float(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )


def episode_calls(name: str, record: dict, n: int) -> float:
    """Mean seconds of one scripted episode's environment calls (no model)."""

    async def one() -> None:
        env = load_environment(name, max_turns=3)
        messages = await _maybe(env.reset(record))
        messages.append({"role": "assistant", "content": CALL})
        result = await env.step(messages)
        messages += [*result.messages, {"role": "assistant", "content": "#### 943"}]
        assert (await env.step(messages)).messages is None

    async def run() -> float:
        await one()  # warm
        start = time.perf_counter()
        for _ in range(n):
            await one()
        return (time.perf_counter() - start) / n

    return asyncio.run(run())


async def _maybe(value):
    return await value if asyncio.iscoroutine(value) else value


def ppo(name: str, root: Path, args: argparse.Namespace) -> dict:
    train, _ = calc_splits(0, args.prompts * args.iterations, 0)
    if name == VERIFIERS:
        rows = [
            {"prompt": p.question, "answer": str(p.value), "system_prompt": SYSTEM_PROMPT}
            for p in train
        ]
        extra = ["data.prompt_key=prompt", "env.args={max_turns: 3}"]
    else:
        rows = [p.to_record() for p in train]
        extra = ["env.args={max_turns: 3}"]
    root.mkdir(parents=True, exist_ok=True)
    data = root / f"{name.replace(':', '_')}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = root / f"run-{name.replace(':', '_')}"
    config = load_config(
        "ppo-lora-tiny",
        [
            f"model.path={tiny_calc_path()}", f"data.train_path={data}", f"run_dir={run_dir}",
            f"backend={args.backend}", "mesh.fsdp=1", "mesh.tensor=-1", f"env.name={name}",
            "ppo.reward=none", "env.max_turns=3", "env.max_episode_tokens=256",
            "generation.max_new_tokens=32", "ppo.advantage_estimator=grpo", "ppo.kl_in_reward=false",
            f"ppo.steps={args.iterations}", f"ppo.prompts_per_step={args.prompts}",
            f"ppo.num_generations_per_prompt={args.group}",
            f"ppo.mini_batch_size={args.prompts * args.group}", "ppo.validate_every=0",
            "checkpoint.every_steps=1000", *extra,
        ],
    )  # fmt: skip
    start = time.perf_counter()
    run_ppo(config)
    wall = time.perf_counter() - start
    rows = read_metrics(run_dir / "metrics.jsonl")
    later = rows[1:] or rows
    return {
        "wall_s": wall,
        "step_s": statistics.median(r["timing/step"] for r in later),
        "generate_s": statistics.median(r["timing/generate"] for r in later),
        "reward/correct": [round(r["reward/correct"], 3) for r in rows],
        "env/tool_calls": [round(r["env/tool_calls"], 3) for r in rows],
        "reward/used_tool": [round(r.get("reward/used_tool", float("nan")), 3) for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="torch", choices=["torch", "jax"])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=200, help="scripted episodes timed")
    args = parser.parse_args()
    print(f"import verifiers.v1 (fresh process): {import_seconds():.2f} s")
    start = time.perf_counter()
    load_environment(VERIFIERS)
    print(f"load the taskset (import of the module included): {time.perf_counter() - start:.2f} s")
    record = {"prompt": "What is 23 * 41?", "answer": "943", "system_prompt": SYSTEM_PROMPT}
    gsm8k = {"question": "What is 23 * 41?", "answer": "943"}
    for name, rec in (("calculator", gsm8k), (VERIFIERS, record)):
        print(
            f"{name}: one scripted episode's env calls {1e3 * episode_calls(name, rec, args.episodes):.2f} ms"
        )
    with tempfile.TemporaryDirectory() as tmp:
        warm = argparse.Namespace(**{**vars(args), "iterations": 1})
        ppo("calculator", Path(tmp) / "warm-up", warm)  # the backend's first-run costs
        for name in ("calculator", VERIFIERS):
            print(name, json.dumps(ppo(name, Path(tmp), args)))


if __name__ == "__main__":
    main()
