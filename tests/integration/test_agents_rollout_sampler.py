"""strop.agents.rollout on a real sampler: the torch policy (the shipped tiny-math model)
plays 2-turn episodes through ``sampler_generate`` (re-prefill each turn)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import strop
from strop.agents.continuation import sampler_generate
from strop.agents.environment import StepResult
from strop.agents.rollout import RolloutLimits, run_episodes
from strop.config import load_config
from strop.data import Tokenizer
from strop.generation import Decoding, SamplingParams

torch = pytest.importorskip("torch")

MODEL = Path(strop.__file__).parent / "assets" / "tiny-math"


class TwoTurns:
    """Asks again once, then scores the episode by how many turns it took."""

    def reset(self, record):
        return [{"role": "user", "content": record["question"]}]

    def step(self, messages):
        if sum(m["role"] == "assistant" for m in messages) < 2:
            return StepResult([{"role": "user", "content": "Check it: what is 2 + 2?"}])
        return StepResult(None, {"done": 1.0})


def test_torch_sampler_plays_two_turn_episodes(tmp_path) -> None:
    from strop.backends import get_backend

    overrides = ["backend=torch", f"model.path={MODEL}", "mesh.fsdp=1", "mesh.data=-1"]
    config = load_config("tiny", [*overrides, f"run_dir={tmp_path}"])
    policy = get_backend("torch").build_policy(config)
    tok = Tokenizer.from_pretrained(MODEL)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    decoding = Decoding(seed=3, eos_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id)
    records = [{"question": "What is 3 + 4?"}, {"question": "What is 12 * 3?"}]
    limits = RolloutLimits(max_turns=3, max_new_tokens=10, max_episode_tokens=200)

    def play():
        calls = []
        inner = sampler_generate(policy, params, decoding)

        def generate(prefixes, max_new_tokens):
            turns = inner(prefixes, max_new_tokens)
            calls.append((prefixes, turns))
            return turns

        return run_episodes(records, TwoTurns, tok, generate, limits), calls

    outcomes, calls = play()
    assert [len(prefixes) for prefixes, _ in calls] == [2, 2]
    for row, outcome in enumerate(outcomes):
        ep = outcome.episode
        assert outcome.error is None and outcome.turns == 2 and outcome.rewards == {"done": 1.0}
        # Each turn was sampled from the episode's ids so far and appended unchanged.
        for (prefixes, turns), (start, end) in zip(calls, ep.turns, strict=True):
            assert ep.ids[:start] == prefixes[row]
            assert ep.ids[start:end] == turns[row].ids[: end - start]
            assert ep.sampled[start:end] == [1] * (end - start)
        assert sum(ep.sampled) == sum(end - start for start, end in ep.turns)
        sampled = [lp for lp, m in zip(ep.logprobs, ep.sampled, strict=True) if m]
        assert all(math.isfinite(lp) and lp <= 0 for lp in sampled)
        assert all(math.isnan(lp) for lp, m in zip(ep.logprobs, ep.sampled, strict=True) if not m)
        # The sampling log-probs are the model's over the whole episode (temperature 1).
        with torch.no_grad():
            logits = policy.model(torch.tensor([ep.ids])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        positions = [i for i, m in enumerate(ep.sampled) if m]
        forced = [float(logp[i - 1, ep.ids[i]]) for i in positions]
        assert forced == pytest.approx(sampled, abs=2e-4)
    again, _ = play()  # the same seed, the same episodes
    for a, b in zip(outcomes, again, strict=True):
        assert a.episode.ids == b.episode.ids and a.episode.logprobs == b.episode.logprobs
