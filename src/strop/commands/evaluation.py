"""`strop eval`: accuracy of a model or adapter on a held-out split, on either backend.

Each example's prompt (tokenized as in training) gets ``eval.num_samples`` responses —
greedy when ``eval.temperature`` is 0 — and the reward ``eval.reward`` (default
``gsm8k``: the final answer checked against the gold; or a function of the user's,
``package.module:function`` / ``path/to/file.py:function``, which gets every column of
the records) decides which are correct (score >= 1).
An example is solved if any of its responses is (pass@k); ``accuracy`` is the mean over
all responses. Each record's gold is found as the reward says
(:func:`strop.data.prompts.gold_answers`) before the model is built: a record without one is
refused by file:line (skipped with ``data.skip_bad_lines=true``). Outputs, written only when
complete:

- ``<run_dir>/eval/results.jsonl``: per example the prompt, responses, extracted
  answers, gold and correctness;
- ``<run_dir>/eval/summary.json``: the numbers returned in :class:`EvalResult`.

With ``env.name`` each record (read as ``strop ppo`` reads its validation records:
:class:`~strop.rl.prompts.PromptSet`; every key goes to the environment's ``reset``) is
played as ``eval.num_samples`` multi-turn episodes by :class:`~strop.rl.episodes.Episodes`
on the run's rollout engine, at ``eval.temperature`` (0: greedy, as validation plays) with
the ``generation.*`` and ``env.*`` limits, and judged as validation judges it
(:meth:`Episodes.judge <strop.rl.episodes.Episodes.judge>`): correct when the episode's
reward, its environment's parts summed, is >= 1. ``eval.reward`` does not apply (the config
refuses one with ``env.name``). ``metrics`` holds the episodes' ``env/*`` and
``reward/<part>`` means over the whole evaluation
(:func:`~strop.agents.rollout.episode_metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from strop import rewards
from strop.agents.rollout import EpisodeOutcome, episode_metrics
from strop.config import Config
from strop.data import Tokenizer, policy_tokenizer, read_data_file
from strop.data.prompts import gold_answers, prompt_ids, record_columns
from strop.engines import RolloutEngine, rollout_engine
from strop.errors import ConfigError
from strop.generation import SamplingParams
from strop.io.atomic import write_text_atomically
from strop.io.model_spec import check_context_length, response_end_ids
from strop.io.peft import adapter_lora
from strop.models import ModelSpec
from strop.rl.episodes import Episodes
from strop.rl.prompts import PromptSet
from strop.run.job import Job, eval_job
from strop.scoring import build_reward_model, sample_and_score

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    """What an evaluation measured (also written as ``summary.json``)."""

    path: str
    examples: int
    samples_per_example: int
    pass_at_k: float
    accuracy: float
    mean_response_tokens: float
    stopped_fraction: float
    reward_timeouts: int
    reward_errors: int  # responses the reward failed on (raised, NaN/Inf): scored 0, wrong
    seconds: float
    tokens_per_s: float
    results_path: str
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # env/*, reward/*
    is_main: bool = True  # False on every process but the first of a distributed run


def _config_with_adapter(config: Config, spec: ModelSpec) -> Config:
    """``config`` with its ``lora:`` section describing ``eval.adapter`` (if one is given),
    checked against the base model's ``spec`` before its r and targets size the model
    built for it."""
    if config.eval.adapter is None:
        return config
    lora = adapter_lora(config.lora, config.eval.adapter, spec)
    return config.model_copy(update={"lora": lora})


def run_eval(config: Config) -> EvalResult:
    """Evaluate ``config.model.path`` (plus ``eval.adapter``) on ``eval.path``."""
    path = config.eval.path or config.data.eval_path
    if config.model.path is None or path is None:
        raise ConfigError("strop eval needs model.path and eval.path (or data.eval_path)")
    if config.env.enabled:  # the environment's reward parts score the episodes
        with eval_job(config, {"solved": "solved {:.1%}"}) as job:  # preflight first
            return _evaluate_episodes(config, path, job)
    limits = rewards.RewardLimits.of(config.eval, "eval")  # a deadline: user functions in a worker
    reward = rewards.load(
        config.eval.reward, setting="eval.reward", build_model=partial(build_reward_model, config),
        limits=limits,
    )  # fmt: skip
    with eval_job(config, {"solved": "solved {:.1%}"}) as job:  # preflight first
        try:
            return _evaluate(config, path, reward, job)
        finally:
            reward.close()


def _evaluate(config: Config, path: str, reward, job: Job) -> EvalResult:
    progress = job.progress
    progress.phase("reading the data")
    spec = job.facts.model_spec(config)
    config = _config_with_adapter(config, spec)
    tokenizer = policy_tokenizer(config)
    examples, _ = read_data_file(path, config.data)
    # Every record's gold, as the reward finds it (refused by file:line if it has none),
    # before the model is built: the reward is scored against these, not whole completions.
    examples, golds = gold_answers(
        examples, reward, setting="eval.reward", skip_bad_lines=config.data.skip_bad_lines
    )
    if config.eval.max_examples:
        examples, golds = examples[: config.eval.max_examples], golds[: config.eval.max_examples]
    columns = record_columns(examples)  # what the reward gets; a gold rule's reward, its golds
    columns["answer"] = golds if reward.gold is not None else columns["answer"]
    reward.check_call(columns)
    prompts = [prompt_ids(example, tokenizer) for example in examples]
    progress.set_total(len(examples))
    longest = max(len(p) for p in prompts)
    check_context_length(  # before the weights load
        spec, config.model_path(), samples=True, max_length=config.data.max_length,
        max_new_tokens=config.generation.max_new_tokens, longest_prompt=longest,
    )  # fmt: skip

    reward.start()  # its worker imports the user's function while the model loads
    progress.phase("loading the model")
    policy = job.backend.build_policy(config)
    if config.eval.adapter is not None:  # before the engine: a new engine samples it
        policy.load_adapter(config.eval.adapter)
    with rollout_engine(config, policy, max_prompt_tokens=longest) as rollouts:
        result = _sample_and_record(
            config, path, reward, job, rollouts, tokenizer, examples, golds, columns, prompts
        )
    return dataclasses.replace(result, is_main=policy.is_main)


def _sample_and_record(
    config: Config, path: str, reward, job: Job, rollouts: RolloutEngine,
    tokenizer: Tokenizer, examples, golds, columns, prompts: list[list[int]],
) -> EvalResult:  # fmt: skip
    # generation: supplies length, top-k/top-p and stop strings; eval: the temperature
    params = dataclasses.replace(
        SamplingParams.from_config(config.generation), temperature=config.eval.temperature
    )
    eos_ids = response_end_ids(job.facts.model_spec(config), tokenizer.eos_token_id)
    k = config.eval.num_samples

    records, tokens, stopped = [], 0, 0
    began = time.perf_counter()
    progress = job.progress
    progress.phase("")
    solved = correct = 0
    for start in range(0, len(examples), config.eval.batch_size):
        batch = range(start, min(start + config.eval.batch_size, len(examples)))
        rows = [i for i in batch for _ in range(k)]

        def score(texts: list[str], rows: list[int] = rows) -> list[float]:
            asked = [examples[i].prompt or "" for i in rows]
            return reward(asked, texts, **{n: [v[i] for i in rows] for n, v in columns.items()})

        scored = sample_and_score(
            rollouts, [prompts[i] for i in rows], params, score, seed=config.seed + start,
            eos_ids=eos_ids, tokenizer=tokenizer,
        )  # fmt: skip
        texts, scores = scored.texts, scored.scores
        tokens += int(scored.generation.lengths.sum())
        stopped += sum(reason == "stop" for reason in scored.generation.finish_reasons)
        for j, i in enumerate(batch):
            mine = slice(j * k, (j + 1) * k)
            hits = [score >= 1.0 for score in scores[mine]]
            solved += any(hits)
            correct += sum(hits)
            records.append(
                {
                    "index": i,
                    "source": f"{examples[i].source}:{examples[i].line}",
                    "prompt": tokenizer.decode(prompts[i], skip_special_tokens=True),
                    "responses": texts[mine],
                    "extracted": [rewards.extract_answer(t) for t in texts[mine]],
                    "gold": golds[i] if reward.gold else rewards.extract_gold(golds[i]),
                    "correct": hits,
                    "solved": any(hits),
                }
            )
        done = batch.stop
        progress.update(done, solved=solved / done)
    seconds = time.perf_counter() - began

    out_dir = Path(config.run_dir) / "eval"
    result = EvalResult(
        path=str(path),
        examples=len(examples),
        samples_per_example=k,
        pass_at_k=solved / max(len(examples), 1),
        accuracy=correct / max(len(examples) * k, 1),
        mean_response_tokens=tokens / max(len(examples) * k, 1),
        stopped_fraction=stopped / max(len(examples) * k, 1),
        reward_timeouts=reward.stats.timeouts,
        reward_errors=reward.stats.errors,
        seconds=seconds,
        tokens_per_s=tokens / max(seconds, 1e-9),
        results_path=str(out_dir / "results.jsonl"),
    )
    _write_results(job, result, records)
    return result


def _write_results(job: Job, result: EvalResult, records: list[dict]) -> None:
    """``results.jsonl`` (one record per example) and ``summary.json``, by the main process."""
    summary = {k: v for k, v in asdict(result).items() if k != "is_main"}
    out_dir = Path(result.results_path).parent

    def write() -> None:
        write_text_atomically(
            out_dir / "results.jsonl", "".join(json.dumps(r) + "\n" for r in records)
        )
        write_text_atomically(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    job.backend.write_once(write, f"writing the results in {out_dir}")


# env.name: episodes -----------------------------------------------------------------


def _evaluate_episodes(config: Config, path: str, job: Job) -> EvalResult:
    """Evaluate ``config.model.path`` (plus ``eval.adapter``) on ``path`` by episodes in
    ``env.name`` (see the module docstring); writes ``<run_dir>/eval/`` as single-turn
    evaluation does."""
    progress = job.progress
    progress.phase("reading the data")
    spec = job.facts.model_spec(config)
    config = _config_with_adapter(config, spec)
    tokenizer = policy_tokenizer(config)
    stops = response_end_ids(spec, tokenizer.eos_token_id)
    episodes = Episodes.from_config(config, tokenizer, stops, job.environment)
    assert episodes is not None  # env.name is set
    prompts = PromptSet.read(path, config, tokenizer, config.eval.max_examples)
    check_context_length(  # before the weights load
        spec, config.model_path(), samples=True, max_length=config.data.max_length,
        max_new_tokens=config.generation.max_new_tokens, longest_prompt=prompts.longest,
        max_episode_tokens=config.env.max_episode_tokens,
    )  # fmt: skip
    progress.set_total(len(prompts))
    progress.phase("loading the model")
    policy = job.backend.build_policy(config)
    if config.eval.adapter is not None:  # before the engine: a new engine samples it
        policy.load_adapter(config.eval.adapter)
    with rollout_engine(config, policy, max_prompt_tokens=episodes.longest_prefix) as rollouts:
        result, records = _play(config, path, job, episodes, rollouts, prompts)
    _write_results(job, result, records)
    return dataclasses.replace(result, is_main=policy.is_main)


def _play(
    config: Config, path: str, job: Job, episodes: Episodes, rollouts: Any, prompts: PromptSet
) -> tuple[EvalResult, list[dict[str, Any]]]:
    # generation: supplies the turn length and stop strings (top-k/top-p); eval: temperature
    params = dataclasses.replace(
        SamplingParams.from_config(config.generation), temperature=config.eval.temperature
    )
    k = config.eval.num_samples
    records: list[dict[str, Any]] = []
    outcomes: list[EpisodeOutcome] = []
    solved = correct = 0
    began = time.perf_counter()
    job.progress.phase("")
    for start in range(0, len(prompts), config.eval.batch_size):
        batch = range(start, min(start + config.eval.batch_size, len(prompts)))
        rows = [i for i in batch for _ in range(k)]
        judged = episodes.judge(rollouts, prompts, rows, params, seed=config.seed + start)
        outcomes += judged.outcomes
        for j, i in enumerate(batch):
            mine = slice(j * k, (j + 1) * k)
            hits, samples = judged.correct[mine], judged.samples[mine]
            solved += any(hits)
            correct += sum(hits)
            records.append(_record(i, samples, judged.outcomes[mine], hits))
        job.progress.update(batch.stop, solved=solved / batch.stop)
    seconds = time.perf_counter() - began
    episodes_run = max(len(outcomes), 1)
    sampled = sum(sum(o.episode.sampled) if o.episode else 0 for o in outcomes)
    ended = sum(o.error is None and not o.truncated for o in outcomes)
    result = EvalResult(
        path=str(path),
        examples=len(prompts),
        samples_per_example=k,
        pass_at_k=solved / max(len(prompts), 1),
        accuracy=correct / episodes_run,
        mean_response_tokens=sampled / episodes_run,
        stopped_fraction=ended / episodes_run,
        reward_timeouts=0,
        reward_errors=0,  # an environment's failures are env/errors
        seconds=seconds,
        tokens_per_s=sampled / max(seconds, 1e-9),
        results_path=str(Path(config.run_dir) / "eval" / "results.jsonl"),
        metrics=episode_metrics(outcomes),
    )
    return result, records


def _record(
    index: int, samples: list[dict[str, Any]], outcomes: list[EpisodeOutcome], hits: list[bool]
) -> dict[str, Any]:
    """One example's line of ``results.jsonl``: its episodes side by side."""
    return {
        "index": index,
        "prompt": samples[0]["prompt"],  # the opening, with its chat markers
        "responses": [s["response"] for s in samples],  # the rest of each episode
        "extracted": [s["extracted"] for s in samples],
        "gold": samples[0]["gold"],
        "rewards": [dict(o.rewards) for o in outcomes],
        "turns": [o.turns for o in outcomes],
        "tool_calls": [int(o.info.get("tool_calls", 0)) for o in outcomes],
        "truncated": [o.truncated for o in outcomes],
        "errors": [o.error for o in outcomes],
        "correct": hits,
        "solved": any(hits),
    }
