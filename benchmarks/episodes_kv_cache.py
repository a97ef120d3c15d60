"""Multi-turn rollouts with and without KV-cache continuation (``env.kv_cache``), per backend.

A round of ``--episodes`` episodes of exactly ``--turns`` model turns each (a scripted
environment answers every turn with a ~30-token message until the last), played by the
PPO actor's native sampler (the ``ppo-lora-tiny`` recipe's actor, LoRA included, at the
run's fixed prompt width ``env.max_episode_tokens - 1``, as ``strop ppo`` plays them), at
temperature 1 with one seed, so both modes sample the same episodes. Each mode makes one
warm-up round (JAX compiles there; its count of compiles is printed), then ``--repeats``
timed rounds; printed: the mean wall time of a round, the sampled and total tokens, and
whether both modes gave the same episodes.

    python benchmarks/episodes_kv_cache.py                     # tiny-calc, both backends
    python benchmarks/episodes_kv_cache.py --backends torch --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for benchmarks.report

from benchmarks.report import cpu_name

from strop.agents.environment import StepResult
from strop.assets import tiny_calc_path
from strop.config import load_config
from strop.data import Tokenizer
from strop.engines import NativeEngine
from strop.generation import SamplingParams
from strop.objectives.roles import RolePlan
from strop.rl.episodes import Episodes
from strop.run.preflight import check_environment

TURNS = [4]


class Scripted:
    """Answers each model turn with a tool-result message until the episode's last turn."""

    def reset(self, record):
        return [{"role": "user", "content": record["question"]}]

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns >= TURNS[0]:
            return StepResult(None, {"done": 1.0})
        text = f"<tool_response>\n{turns * 1234567 % 99991} is the result of step {turns}\n"
        return StepResult([{"role": "user", "content": text + "</tool_response>"}])


def run(backend: str, args: argparse.Namespace) -> list[list[str]]:
    from strop.backends import get_backend

    overrides = [
        f"backend={backend}", f"model.path={args.model}", "mesh.fsdp=1", "mesh.data=-1",
        f"run_dir={tempfile.mkdtemp()}", "env.name=calculator", "ppo.reward=none",
        f"generation.max_new_tokens={args.max_new_tokens}",
        f"env.max_episode_tokens={args.max_episode_tokens}",
        f"env.max_turns={args.turns}",
    ]  # fmt: skip
    config = load_config("ppo-lora-tiny", overrides)
    tok = Tokenizer.from_pretrained(args.model)
    environment = check_environment(config.env.name, config.env.args)
    episodes = Episodes.from_config(config, tok, [tok.eos_token_id], environment)
    episodes = dataclasses.replace(episodes, factory=Scripted)
    actor = get_backend(backend).build_actor_critic(
        config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
    )
    actor.expect_prompts(episodes.longest_prefix)
    engine = NativeEngine(actor)
    records = [{"question": f"What is {17 * k + 3} * {29 * k + 11}?"} for k in range(args.episodes)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    rows, played = [], {}
    for kv_cache in (False, True):
        mode = dataclasses.replace(episodes, kv_cache=kv_cache)
        traces = _traces(backend)
        began = time.perf_counter()
        mode.play(engine, records, params, seed=0)
        warm = time.perf_counter() - began
        compiles = _delta(traces, _traces(backend)) if traces is not None else None
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            outcomes = mode.play(engine, records, params, seed=0)
            times.append(time.perf_counter() - began)
        played[kv_cache] = [o.episode.ids for o in outcomes]
        sampled = sum(sum(o.episode.sampled) for o in outcomes)
        total = sum(len(o.episode.ids) for o in outcomes)
        turns = sum(o.turns for o in outcomes) / len(outcomes)
        rows.append([
            backend, "continue (kv_cache)" if kv_cache else "re-prefill", f"{warm:.2f}",
            "-" if compiles is None else compiles, f"{sum(times) / len(times):.3f}",
            f"{turns:.1f}", str(sampled), str(total),
        ])  # fmt: skip
    same = played[False] == played[True]
    for row in rows:
        row.append("yes" if same else "NO")
    return rows


def _traces(backend: str) -> dict[str, int] | None:
    """JAX's traces (= compiles) so far, by program."""
    if backend != "jax":
        return None
    from strop.backends.jax.continuation import CONTINUATION_TRACES
    from strop.backends.jax.generate import TRACES

    return {
        "prefill": TRACES.prefill, "decode": TRACES.decode,
        "chunk prefill": CONTINUATION_TRACES.prefill, "store": CONTINUATION_TRACES.store,
    }  # fmt: skip


def _delta(before: dict[str, int], after: dict[str, int]) -> str:
    counts = {name: after[name] - before[name] for name in after}
    parts = ", ".join(f"{name} {n}" for name, n in counts.items() if n)
    return f"{sum(counts.values())} ({parts})" if parts else "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["jax", "torch"])
    parser.add_argument("--model", default=str(tiny_calc_path()))
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-episode-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    TURNS[0] = args.turns
    print(f"{datetime.date.today()} {platform.node()} {cpu_name()}; {args}")
    header = ["backend", "mode", "warm-up s", "compiles", "round s", "turns", "sampled", "tokens"]
    print("| " + " | ".join([*header, "same episodes"]) + " |")
    print("|" + "---|" * (len(header) + 1))
    for backend in args.backends:
        for row in run(backend, args):
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
