"""KV-cache continuation = re-prefill (issue 36): multi-turn episodes played by the native
samplers (the PPO actor of a random one-layer model, at its run's fixed prompt width:
few compiles) give the same tokens, and log-probs within 1e-5,
whether each turn continues from the previous turn's KV cache (``env.kv_cache=true``) or
re-prefills the whole episode; greedy and sampled, on JAX and torch. The episodes end after
1 to 4 turns (rows drop out of later calls), a group shares its prompt, and the
environment's messages are of several lengths (several chunk widths). On JAX the decoder is
an OLMo 2 with attention biases (q/k norms over the whole projections, whose keys are normed
before they are cached, and norms after the sub-layers): the Qwen2 decoder's paths and
more, at the cost of one case."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from strop.agents.environment import StepResult
from strop.config import load_config
from strop.data import Tokenizer
from strop.engines import NativeEngine
from strop.generation import SamplingParams
from strop.io.tiny import make_tiny_checkpoint
from strop.objectives.roles import RolePlan
from strop.rl.episodes import Episodes
from strop.run.preflight import check_environment
from tests.tiny_models import build_tiny_model


class Scripted:
    """Answers each model turn with a message of a length set by the record, until the
    record's number of turns."""

    def reset(self, record):
        self.record = record
        return [{"role": "user", "content": record["question"]}]

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns >= self.record["turns"]:
            return StepResult(None, {"done": 1.0})
        text = "Result: " + " 7" * (self.record["words"] * turns)
        return StepResult([{"role": "user", "content": text}], {"done": 0.0})


RECORDS = [
    {"question": "What is 12 * 34?", "turns": 4, "words": 6},
    {"question": "What is 12 * 34?", "turns": 2, "words": 1},  # a group: the same prompt
    {"question": "Compute 981 + 77 - 5.", "turns": 1, "words": 3},
    {"question": "How much is 3 * 7?", "turns": 3, "words": 4},
    {"question": "How much is 3 * 7?", "turns": 4, "words": 2},
]


def with_random_decoder(model_dir, kind: str, **config):
    """``model_dir``'s tokenizer with a random one-layer decoder of tests/tiny_models.py's
    ``kind`` in place of its Qwen2 (same vocabulary and special ids)."""
    ours = json.loads((model_dir / "config.json").read_text())
    ids = {key: ours[key] for key in ("vocab_size", "eos_token_id", "pad_token_id")}
    model = build_tiny_model(kind, seed=1, num_hidden_layers=1, **ids, **config)
    model.save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_continuing_from_the_kv_cache_samples_what_re_prefilling_does(backend, tmp_path) -> None:
    from strop.backends import get_backend

    texts = [r["question"] for r in RECORDS] + ["Result: 7 7 7", "The answer is 408."]
    model = make_tiny_checkpoint(tmp_path / "model", texts * 20, layers=1, seed=1)
    if backend == "jax":
        model = with_random_decoder(model, "olmo2", attention_bias=True)
    overrides = [f"backend={backend}", f"model.path={model}", "lora.enabled=false"]
    overrides += ["mesh.fsdp=1", "mesh.data=-1", f"run_dir={tmp_path}", "env.name=calculator"]
    overrides += ["ppo.reward=none"]
    overrides += ["generation.max_new_tokens=6", "env.max_episode_tokens=250"]
    config = load_config("ppo-lora-tiny", overrides)
    tok = Tokenizer.from_pretrained(model)
    environment = check_environment(config.env.name, config.env.args)
    cached = Episodes.from_config(config, tok, [tok.eos_token_id], environment)
    assert cached.kv_cache  # the default
    off = load_config("ppo-lora-tiny", [*overrides, "env.kv_cache=false"])
    prefilled = Episodes.from_config(off, tok, [tok.eos_token_id], environment)
    assert not prefilled.kv_cache
    cached = dataclasses.replace(cached, factory=Scripted)
    prefilled = dataclasses.replace(prefilled, factory=Scripted)
    actor = get_backend(backend).build_actor_critic(
        config, total_updates=1, plan=RolePlan.from_config(config), checkpoints=None
    )
    actor.expect_prompts(cached.longest_prefix)  # as `strop ppo` does

    reused = []  # per call: how many ids each row took from its cache
    start = actor.start_session

    def spying(decoding):
        session = start(decoding)
        inner = session.generate

        def generate(prefixes, params, seed, rows):
            reused.append([(len(p), c) for p, c in zip(prefixes, rows.cached, strict=True)])
            return inner(prefixes, params, seed, rows)

        session.generate = generate
        return session

    actor.start_session = spying
    policy = NativeEngine(actor)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=6, temperature=temperature)
        reused.clear()
        a = cached.play(policy, RECORDS, params, seed=11)
        assert len(reused) == 4 and all(c == 0 for _, c in reused[0])
        # later turns prefill the last sampled token and the environment's message only
        for t, call in enumerate(reused[1:], start=1):
            turns = [o.episode.turns for o in a if o.turns > t]
            expected = [(spans[t][0], spans[t - 1][1] - 1) for spans in turns]
            assert call[: len(expected)] == expected
        b = prefilled.play(policy, RECORDS, params, seed=11)
        assert len(reused) == 4  # re-prefilling opens no session
        assert [o.turns for o in a] == [r["turns"] for r in RECORDS]
        for x, y in zip(a, b, strict=True):
            assert x.error is None and y.error is None
            assert x.episode.ids == y.episode.ids
            assert x.episode.sampled == y.episode.sampled
            mask = np.asarray(x.episode.sampled, dtype=bool)
            np.testing.assert_allclose(
                np.asarray(x.episode.logprobs)[mask], np.asarray(y.episode.logprobs)[mask],
                atol=1e-5, rtol=0,
            )  # fmt: skip
