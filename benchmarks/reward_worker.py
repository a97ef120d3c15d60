"""Per-call cost of running a user reward (``file.py:fn``) in its killable worker process
(``ppo.reward_timeout_s`` > 0, the default) against calling it in the trainer
(``reward_timeout_s: 0``), on batches the size of PPO iterations.

    .venv/bin/python benchmarks/reward_worker.py --calls 200
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from strop.rewards import RewardLimits
from strop.rewards.loading import load

REWARD = """
def score(prompts, completions, **columns):
    return [float(len(c) % 2) for c in completions]
"""


def per_call_ms(reward, items: int, chars: int, calls: int) -> float:
    prompts = ["q" * 64] * items
    completions = ["a" * chars] * items
    reward(prompts, completions)  # warm: the worker is up, the function imported
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        reward(prompts, completions)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "my_reward.py"
        path.write_text(REWARD)
        ref = f"{path}:score"
        rewards = {
            "in the trainer": load(ref, limits=RewardLimits(None, None, "ppo")),
            "in a worker": load(ref, limits=RewardLimits(300.0, None, "ppo")),
        }
        start = time.perf_counter()
        rewards["in a worker"].start()
        rewards["in a worker"](["q"], ["a"])
        print(f"worker start + first call: {time.perf_counter() - start:.2f} s")
        print("items  chars  " + "  ".join(f"{k:>16}" for k in rewards) + "  (median ms per call)")
        for items, chars in ((32, 200), (64, 2000)):
            row = [per_call_ms(r, items, chars, args.calls) for r in rewards.values()]
            print(f"{items:5d}  {chars:5d}  " + "  ".join(f"{v:16.3f}" for v in row))
        for reward in rewards.values():
            reward.close()


if __name__ == "__main__":
    main()
