"""Multi-turn episodes (``env.name``) on ``generation.engine=vllm``: `strop ppo` (torch)
trains on calculator episodes sampled by vLLM, the engine syncs the actor's adapter before
each iteration's episodes, vLLM's greedy turns (token ids, continued from each episode's
ids of different lengths) equal the native sampler's on the same weights, and `strop eval`
on vLLM with the run's adapter counts those episodes.

An episode budget of the model's whole context (512 positions): vLLM's ``max_model_len`` is
the budget, not the longest prefix + ``generation.max_new_tokens`` (past the model's
positions, which vLLM refuses). The PPO run's engine is kept open after the run for the
comparison (its start-up is most of the time); eval builds its own."""

from __future__ import annotations

import json

import numpy as np

from strop.agents.calculator_tasks import write_calc_splits
from strop.assets import tiny_calc_path
from strop.commands.evaluation import run_eval
from strop.config import load_config
from strop.data import Tokenizer
from strop.engines.vllm import VllmEngine
from strop.engines.vllm_sync import VllmRollouts
from strop.generation import SamplingParams
from strop.io.model_spec import read_model_spec, response_end_ids
from strop.metrics.sinks import read_metrics
from strop.rl.episodes import Episodes
from strop.rl.ppo import run_ppo
from strop.run.preflight import check_environment

ENV_METRICS = {"env/turns", "env/tool_calls", "env/tool_errors", "env/truncated", "env/errors"}
LOGPROB_BOUND = 2e-4  # float32: vLLM's and the trainer's kernels differ in reduction order


def test_ppo_on_vllm_episodes_syncs_before_each_iteration_and_greedy_turns_are_native(
    tmp_path, monkeypatch
):
    data = write_calc_splits(tmp_path / "data", seed=0, n_train=4, n_validation=4)
    config = load_config(
        "ppo-lora-tiny",
        [
            f"model.path={tiny_calc_path()}", f"data.train_path={data['train']}",
            f"run_dir={tmp_path / 'run'}", "backend=torch", "generation.engine=vllm",
            "generation.vllm_memory_fraction=0.1", "env.name=calculator", "ppo.reward=none",
            "env.max_episode_tokens=512", "generation.max_new_tokens=40", "ppo.steps=2",
            "ppo.prompts_per_step=2", "ppo.num_generations_per_prompt=2",
            "ppo.mini_batch_size=4", "ppo.validate_every=0", "checkpoint.every_steps=100",
            "logging.tensorboard=false", "optim.lr=0.01",
        ],
    )  # fmt: skip
    engines, events = [], []
    init, sync, sample, close = (
        VllmRollouts.__init__, VllmRollouts.sync, VllmEngine.sample, VllmRollouts.close,
    )  # fmt: skip
    play = Episodes.sample

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)

    def spy_sync(self):
        events.append("sync")
        sync(self)

    def spy_sample(self, prompts, params, decoding):
        events.append(sorted({len(p) for p in prompts}))
        return sample(self, prompts, params, decoding)

    def spy_play(self, *args, **kwargs):
        events.append("iteration")
        return play(self, *args, **kwargs)

    monkeypatch.setattr(VllmRollouts, "__init__", spy_init)
    monkeypatch.setattr(VllmRollouts, "sync", spy_sync)
    monkeypatch.setattr(VllmEngine, "sample", spy_sample)
    monkeypatch.setattr(Episodes, "sample", spy_play)
    monkeypatch.setattr(VllmRollouts, "close", lambda self: None)  # closed below
    run_ppo(config)
    [rollouts] = engines
    try:
        records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"]]
        assert [r["step"] for r in records] == [1, 2]
        for record in records:
            assert record.keys() >= ENV_METRICS, ENV_METRICS - record.keys()
            assert record["env/errors"] == 0.0
            # vLLM's log-probabilities are the trainer's on the actor it trains: at step 2
            # only if the update was pushed into the engine before the episodes
            assert record["mismatch/abs_logprob_diff_max"] < 1e-3, record
        assert records[0]["env/tool_calls"] > 0, "no tool call: the test proves little"
        # The adapter is synced before each iteration's first turn, not in the middle.
        marks = [i for i, event in enumerate(events) if event == "iteration"]
        assert len(marks) == 2 and all(events[i + 1] == "sync" for i in marks), events
        assert events.count("sync") == 2

        # Greedy episodes on the trained weights: vLLM (synced again) = the native sampler.
        tok = Tokenizer.from_pretrained(config.model.path)
        environment = check_environment(config.env.name, config.env.args)
        episodes = Episodes.from_config(
            config,
            tok,
            response_end_ids(read_model_spec(config.model.path), tok.eos_token_id),
            environment,
        )
        lines = data["validation"].read_text().splitlines()
        cases = [json.loads(line) for line in lines]
        greedy = SamplingParams(max_new_tokens=40, temperature=0.0)
        events.clear()
        served = episodes.play(rollouts, cases, greedy, seed=0)
        native = episodes.play(rollouts.model, cases, greedy, seed=0)
        assert events[0] == "sync" and len(events[1]) > 1, events  # ragged prompts in a call
        assert sum(o.turns for o in served) > len(cases), "no second turn: proves little"
        for mine, theirs in zip(served, native, strict=True):
            assert mine.error is None and mine.episode.ids == theirs.episode.ids
            assert mine.episode.turns == theirs.episode.turns and mine.rewards == theirs.rewards
            a, b = mine.episode.columns(), theirs.episode.columns()
            np.testing.assert_array_equal(a.sampled, b.sampled)
            mask = a.sampled == 1
            assert np.abs(a.logprobs[mask] - b.logprobs[mask]).max() < LOGPROB_BOUND
    finally:
        close(rollouts)

    # strop eval with env.name on vLLM (its own engine) and the run's adapter: the episodes
    # above, counted as validation counts them
    monkeypatch.setattr(VllmRollouts, "close", close)
    summary = run_eval(
        load_config(
            "tiny",
            [
                f"model.path={tiny_calc_path()}", f"eval.path={data['validation']}",
                f"eval.adapter={tmp_path / 'run' / 'adapter'}", f"run_dir={tmp_path / 'eval'}",
                "backend=torch", "generation.engine=vllm", "generation.vllm_memory_fraction=0.1",
                "env.name=calculator", "env.max_episode_tokens=512", "generation.max_new_tokens=40",
            ],
        )
    )  # fmt: skip
    assert summary.accuracy == sum(sum(o.rewards.values()) >= 1 for o in native) / len(cases)
    assert summary.metrics["env/turns"] == sum(o.turns for o in native) / len(cases)
    assert summary.metrics["env/episode_tokens"] == sum(len(o.episode) for o in native) / len(cases)
