"""strop.rl.episodes: what the PPO loop does with ``env.name``, on a scripted sampler (the
tiny tokenizer, the real Qwen2.5-Instruct template): episodes played in one generate call
per round at one shape, laid out with holes, scored by their reward parts; an episode its
environment failed keeps a placeholder row with no loss weight; validation's count and
samples."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strop import rewards
from strop.agents import rollout as agents_rollout
from strop.agents.calculator import calculator_environment
from strop.agents.rollout import RolloutLimits
from strop.config import load_config
from strop.errors import ConfigError
from strop.generation import SamplingParams
from strop.rl.episodes import Episodes, add_trainer_reward
from strop.rl.ppo import PpoLoop
from strop.rl.prompts import PromptSet
from strop.run.preflight import check_environment
from tests.unit.test_agents_rollout import RECORDS, SCRIPTS, Scripted, tok  # noqa: F401


class Flaky:
    """The calculator, except that ``reset`` raises for a record marked ``boom``."""

    def __init__(self) -> None:
        self.inner = calculator_environment()
        self.tool_schemas = self.inner.tool_schemas

    def reset(self, record):
        if record.get("boom"):
            raise RuntimeError("no such level")
        return self.inner.reset(record)

    def step(self, messages):
        return self.inner.step(messages)


class ScriptedSampler:
    """A sampler (``generate(prompts, params, **decoding)``) over :class:`Scripted`; records
    each call's rows, max_new_tokens and seed."""

    def __init__(self, tok):  # noqa: F811
        self.scripted, self.calls = Scripted(tok, SCRIPTS), []

    def generate(self, prompts, params, *, seed, eos_ids, pad_id, tokenizer=None):
        self.calls.append((len(prompts), params.max_new_tokens, seed))
        turns = self.scripted(prompts, params.max_new_tokens)
        width = max(len(t.ids) for t in turns)
        tokens = np.full((len(turns), width), pad_id, np.int32)
        logprobs = np.zeros((len(turns), width), np.float32)
        for row, turn in enumerate(turns):
            tokens[row, : len(turn.ids)], logprobs[row, : len(turn.ids)] = turn.ids, turn.logprobs
        lengths = np.asarray([len(t.ids) for t in turns])
        return SimpleNamespace(
            tokens=tokens, logprobs=logprobs, lengths=lengths,
            finish_reasons=[t.finish for t in turns],
        )  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(agents_rollout, "_WARNED", set())


def episodes_of(tok, factory=Flaky, bucket_rows=True):  # noqa: F811
    limits = RolloutLimits(max_turns=4, max_new_tokens=64, max_episode_tokens=2048)
    return Episodes(factory, "flaky", limits, tok, (tok.eos_token_id,), bucket_rows)


def test_an_iteration_plays_episodes_at_one_shape_and_scores_their_parts(tok) -> None:  # noqa: F811
    records = [*RECORDS, {"question": "What is 3 + 4?", "answer": "7", "boom": True}]
    sampler = ScriptedSampler(tok)
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    sample = episodes_of(tok).sample(sampler, records, params, seed=11)
    # One generate call per round, every one at the per-turn limit (one compiled shape),
    # rows padded to a power of two (at most the batch): 3 running of 4 -> 4; 2; 1.
    assert sampler.calls == [(4, 64, 11), (2, 64, 12), (1, 64, 13)]
    rollout = sample.rollout
    assert len(rollout) == 4
    np.testing.assert_array_equal(sample.task_scores, [1.0, 1.0, 1.0, 0.0])
    assert sample.scored.parts == {"correct": [1.0, 1.0, 1.0, 0.0]}
    np.testing.assert_array_equal(sample.no_loss, [False, False, False, True])
    np.testing.assert_array_equal(sample.truncated, [False] * 4)
    # Environment tokens are holes in the mask; the tool's answer is in the first one.
    for row, turns in enumerate(len(SCRIPTS[r["question"]]) for r in RECORDS):
        mask = rollout.response_mask[row, : rollout.lengths[row]]
        assert (np.diff(mask) > 0).sum() == turns - 1
    n = rollout.lengths[0]
    hole = rollout.response_ids[0, :n][rollout.response_mask[0, :n] == 0]
    assert "56088" in tok.decode(hole.tolist())
    # The failed episode's row: a one-token prompt and one token, out of every loss.
    assert rollout.prompt_ids[3] == [tok.pad_token_id] and rollout.lengths[3] == 1
    assert rollout.response_ids[3, 0] == tok.eos_token_id
    metrics = sample.metrics
    assert metrics["env/errors"] == 0.25 and metrics["env/turns"] == pytest.approx(6 / 4)
    assert metrics["env/tool_calls"] == pytest.approx(3 / 4)
    assert metrics["reward/correct"] == 0.75
    assert {"env/tool_errors", "env/truncated", "env/episode_tokens"} <= metrics.keys()
    # Without row buckets (torch) the rows are the running episodes'.
    plain = ScriptedSampler(tok)
    episodes_of(tok, bucket_rows=False).sample(plain, records, params, seed=11)
    assert [rows for rows, _, _ in plain.calls] == [3, 2, 1]


def test_validation_counts_episodes_whose_reward_is_one(tok) -> None:  # noqa: F811
    records = [dict(r) for r in RECORDS]
    records[2]["answer"] = "135"  # its episode answers 134
    columns = {key: [r[key] for r in records] for key in ("question", "answer")}
    prompts = PromptSet([[1]] * 3, columns["answer"], ["q"] * 3, columns)
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0)
    found, samples = episodes_of(tok, calculator_environment).validate(
        ScriptedSampler(tok), prompts, range(3), greedy, 2, seed=0
    )
    assert found == 2 and len(samples) == 2
    assert samples[0]["gold"] == "56088" and samples[0]["reward"] == 1.0
    assert samples[0]["extracted"] == "56088"
    assert "What is 123 * 456?" in samples[0]["prompt"]
    assert "<tool_call>" in samples[0]["response"] and "56088" in samples[0]["response"]


def test_a_sleeping_vllm_engine_stays_awake_through_an_iteration_s_episodes(tok, tmp_path) -> None:  # noqa: F811
    from strop.engines.vllm_sync import VllmRollouts

    scripted = ScriptedSampler(tok)

    class Engine:  # a VllmEngine: records what it is asked
        rank, world_size, calls = 0, 1, []

        def sample(self, prompts, params, decoding):
            self.calls.append("sample")
            return scripted.generate(prompts, params, **decoding.keywords())

        def __getattr__(self, name):  # use_adapter, wake_up, sleep, close
            return lambda *args: self.calls.append(name) or 0

    engine = Engine()
    config = load_config(
        "ppo-lora-tiny", [f"run_dir={tmp_path}", "backend=torch", "generation.vllm_sleep=true"]
    )
    rollouts = VllmRollouts(SimpleNamespace(actor_adapter=dict), engine, config)
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    episodes_of(tok, bucket_rows=False).sample(rollouts, RECORDS, params, seed=0)
    # One wake-up and one sleep around the iteration's rounds (each wake-up reloads weights).
    assert engine.calls.count("sample") == 3 and engine.calls.count("sleep") == 1, engine.calls
    assert engine.calls[-1] == "sleep"
    engine.calls = []  # one call outside episodes: sleeps after it
    scripted.scripted = lambda prompts, n: [agents_rollout.Turn([2], [0.0], "stop")]
    rollouts.generate([[5, 6]], params, seed=0, eos_ids=[2], pad_id=0)
    assert engine.calls == ["wake_up", "sample", "sleep"]


def test_the_run_s_episodes_come_from_the_config_and_need_a_chat_template(tok) -> None:  # noqa: F811
    overrides = ["env.name=calculator", "env.args={max_turns: 2}", "env.max_tool_calls_per_turn=3"]
    overrides += ["env.tool_timeout_s=2.5", "env.tool_workers=5", "env.step_timeout_s=30"]
    config = load_config(None, overrides)
    environment = check_environment(config.env.name, config.env.args)  # preflight's
    episodes = Episodes.from_config(config, tok, [tok.eos_token_id], environment)
    assert episodes.factory().max_turns == 2 and episodes.longest_prefix == 1023
    env = episodes.factory()
    assert (env.max_tool_calls_per_turn, env.call_timeout_s, env.turn_timeout_s) == (3, 2.5, 29)
    assert (episodes.limits.tool_workers, episodes.limits.step_timeout_s) == (5, 30)
    assert Episodes.from_config(load_config(None, []), tok, [0], None) is None
    no_template = SimpleNamespace(chat_template=None)
    with pytest.raises(ConfigError, match="rendered with the model's chat template"):
        Episodes.from_config(config, no_template, [0], environment)


def test_a_trainer_reward_is_added_to_the_environment_s_parts(tok) -> None:  # noqa: F811
    """ppo.reward's weighted terms score each episode's final answer and are summed with its
    environment's parts, as TRL sums reward_funcs with the environment's reward; a weight-0
    term logs its raw score; a failed episode scores 0 there too."""
    records = [*RECORDS, {"question": "What is 3 + 4?", "answer": "7", "boom": True}]
    sample = episodes_of(tok).sample(
        ScriptedSampler(tok), records, SamplingParams(max_new_tokens=64, temperature=1.0), seed=0
    )
    reward = rewards.resolve(
        [{"reward": "format", "weight": 0.5}, {"reward": "gsm8k", "weight": 0, "name": "gold"}]
    )
    columns = {key: [r[key] for r in records] for key in ("question", "answer")}
    prompts = PromptSet([[1]] * 4, columns["answer"], [r["question"] for r in records], columns)
    prompts = PromptSet(**{**prompts.__dict__, "golds_of": {"gold": columns["answer"]}})
    scored = add_trainer_reward(sample, reward, *prompts.reward_inputs(range(4)))
    np.testing.assert_array_equal(scored.task_scores, [1.5, 1.5, 1.5, 0.0])
    assert scored.scored.parts == {
        "correct": [1.0, 1.0, 1.0, 0.0], "format": [1.0, 1.0, 1.0, 0.0], "gold": [1.0, 1.0, 1.0, 0.0],
    }  # fmt: skip
    metrics = {**scored.scored.metrics(), **scored.metrics}
    assert metrics["reward/format"] == metrics["reward/gold"] == 0.75
    assert metrics["reward/items"] == 4 and metrics["env/tool_calls"] == pytest.approx(3 / 4)
    np.testing.assert_array_equal(scored.no_loss, sample.no_loss)
    clash = rewards.resolve([{"reward": "format", "weight": 1, "name": "correct"}])
    with pytest.raises(
        ConfigError, match=r"ppo\.reward's term 'correct' has the name of a reward part"
    ):
        add_trainer_reward(sample, clash, *prompts.reward_inputs(range(4)))


def test_the_ppo_loop_adds_ppo_reward_to_its_episodes(tok) -> None:  # noqa: F811
    overrides = ["env.name=calculator", "ppo.reward=[{reward: format, weight: 0.5}]"]
    overrides += ["ppo.prompts_per_step=3", "ppo.num_generations_per_prompt=1"]
    config = load_config(
        None, [*overrides, "ppo.mini_batch_size=3", "generation.max_new_tokens=64"]
    )
    columns = {key: [r[key] for r in RECORDS] for key in ("question", "answer")}
    train = PromptSet([[1]] * 3, columns["answer"], columns["question"], columns)
    run = SimpleNamespace(
        episodes=episodes_of(tok, calculator_environment), train=train, tokenizer=tok
    )
    reward = rewards.resolve(config.ppo.reward)
    loop = PpoLoop(config, None, ScriptedSampler(tok), run, reward)
    loop._timings = {}
    sample = loop._sample(step=0)
    np.testing.assert_array_equal(sample.task_scores, [1.5, 1.5, 1.5])
    assert sample.scored.parts == {"correct": [1.0] * 3, "format": [1.0] * 3}
    assert {"timing/generate", "timing/reward"} <= loop._timings.keys()
