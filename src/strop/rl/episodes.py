"""Multi-turn episodes in the PPO loop (``env.name``; :mod:`strop.agents`, docs/agents.md).

With an environment, an iteration's records are played as episodes instead of sampled as
single completions (:meth:`Episodes.sample`): ``ppo.num_generations_per_prompt`` episodes
per record, side by side (a group, for the grouped estimators), through
:func:`~strop.agents.rollout.run_episodes` over the rollout engine's ``generate``
(:func:`~strop.agents.continuation.continuation_generate`: with ``env.kv_cache`` each turn
continues from the KV cache of the episode's previous turn, else re-prefills the episode so
far, the same tokens either way; its n-th call seeded ``seed + n``, so an iteration's seed
gives its episodes, resumes included). The episodes are laid out by :meth:`Rollout.from_episodes
<strop.rl.rollout.Rollout.from_episodes>`: environment and tool tokens are holes in the
response mask (context, never a target). Each episode's score is its environment's reward
parts summed over its turns; each part is logged as ``reward/<part>``, with
:func:`~strop.agents.rollout.episode_metrics`' ``env/*``.

An episode with no sampled token (its environment failed before the first turn, or its
opening messages filled ``env.max_episode_tokens``) keeps its row, as a placeholder of one
token; it and every episode its environment failed score 0 (in their group's baseline) and
carry no loss weight (:attr:`Sample.no_loss`): the failure is the environment's, not the
policy's.

Validation (:meth:`Episodes.validate`) and ``strop eval`` with ``env.name``
(:mod:`strop.commands.evaluation`) play one episode per record (:meth:`Episodes.judge`) at their
sampling settings; an episode is correct when its reward (the parts summed) is >= 1, as a
single-turn response is when it scores >= 1. A sampler with an ``awake()`` context (vLLM's
engine, which may sleep between calls) is held awake for an iteration's rounds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from strop.agents.continuation import continuation_generate
from strop.agents.episode import EpisodeColumns
from strop.agents.rollout import (
    EpisodeOutcome,
    RolloutLimits,
    episode_metrics,
    run_episodes,
)
from strop.agents.tool_env import with_run_limits
from strop.config import Config
from strop.data import Tokenizer
from strop.errors import ConfigError
from strop.generation import Decoding, SamplingParams
from strop.rewards import extract_answer
from strop.rewards.weighted import ScoredBatch, WeightedReward
from strop.rl.prompts import PromptSet
from strop.rl.rollout import Rollout


@dataclass(frozen=True)
class Sample:
    """An iteration's rollouts and their scores.

    ``task_scores``: the reward's (single-turn) or the episodes' reward parts summed;
    ``penalty``: the overlong penalty, zeros without one; ``truncated``: rows cut by a
    limit; ``no_loss``: rows that carry no loss weight (an episode its environment failed);
    ``metrics``: the reward's counters (single-turn) or the episodes' ``env/*``.
    """

    rollout: Rollout
    scored: ScoredBatch
    task_scores: np.ndarray
    penalty: np.ndarray
    truncated: np.ndarray
    no_loss: np.ndarray
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Episodes:
    """A run's environment (``env.*``) and how its episodes are played and laid out."""

    factory: Callable[[], Any]  # one environment per episode, with env.args
    name: str
    limits: RolloutLimits
    tokenizer: Tokenizer
    eos_ids: tuple[int, ...]
    bucket_rows: bool = False  # a sampler that compiles each shape (JAX): rows in buckets
    kv_cache: bool = True  # env.kv_cache: continue from the previous turn's cache

    @classmethod
    def from_config(
        cls,
        config: Config,
        tokenizer: Tokenizer,
        eos_ids: Sequence[int],
        environment: Callable[[], Any] | None,
    ) -> Episodes | None:
        """The run's episodes, None without ``env.name``; ``environment``: its factory with
        ``env.args``, which preflight built once (:func:`strop.run.preflight.check_environment`;
        the job's). A model without a chat template is refused (:class:`ConfigError`),
        before any model loads."""
        env = config.env
        if not env.enabled:
            return None
        assert environment is not None, "env.name is set: preflight built its factory"
        if tokenizer.chat_template is None:
            raise ConfigError(
                f"env.name={env.name}: episodes are rendered with the model's chat template, "
                f"and {config.model.path} has none (chat_template in tokenizer_config.json "
                "or chat_template.jinja)"
            )
        limits = RolloutLimits(
            max_turns=env.max_turns,
            max_episode_tokens=env.max_episode_tokens,
            max_new_tokens=config.generation.max_new_tokens,
            step_timeout_s=env.step_timeout_s,
            max_error_fraction=env.max_error_fraction,
            tool_workers=env.tool_workers,
        )
        stops = tuple(int(i) for i in eos_ids)
        jax = config.backend == "jax"
        factory = with_run_limits(
            environment,
            max_tool_calls_per_turn=env.max_tool_calls_per_turn,
            step_timeout_s=env.step_timeout_s,
            tool_timeout_s=env.tool_timeout_s,
        )
        return cls(factory, env.name, limits, tokenizer, stops, jax, env.kv_cache)

    @property
    def longest_prefix(self) -> int:
        """The most tokens a turn is sampled after (what a sampler that compiles each
        shape pads its prompts to): an episode with no room for another token has ended."""
        return max(self.limits.max_episode_tokens - 1, 1)

    def play(
        self, sampler: Any, records: list[dict[str, Any]], params: SamplingParams, seed: int
    ) -> list[EpisodeOutcome]:
        """One episode per record on ``sampler`` (its ``generate``), in the records' order.

        Every turn is sampled up to ``generation.max_new_tokens`` (each row is cut at its
        episode's budget), so that a sampler that compiles each shape compiles one; with
        ``bucket_rows`` the rows are padded up to a power of two (at most the batch) with
        copies of the last one (dropped), so that it compiles once per bucket, not per
        number of episodes still running. A sampler with an ``awake()`` context (vLLM's
        engine) is held awake for all the rounds."""
        decoding = Decoding(seed, self.eos_ids, self.tokenizer.pad_token_id, self.tokenizer)
        inner = continuation_generate(sampler, params, decoding, kv_cache=self.kv_cache)
        width = self.limits.max_new_tokens

        def generate(prefixes: list[list[int]], _budget: int) -> list[Any]:
            n = len(prefixes)
            rows = min(1 << (n - 1).bit_length(), len(records)) if self.bucket_rows else n
            return inner(prefixes + [prefixes[-1]] * (rows - n), width)[:n]

        # an engine that sleeps between calls (vLLM's vllm_sleep) stays up for the episodes
        awake = getattr(sampler, "awake", None)
        with awake() if awake is not None else nullcontext():
            return run_episodes(
                records, self.factory, self.tokenizer, generate, self.limits,
                name=self.name, stop_ids=self.eos_ids,
            )  # fmt: skip

    def layout(self, outcomes: Sequence[EpisodeOutcome]) -> tuple[Rollout, np.ndarray]:
        """The episodes as one rollout, a placeholder row for each with no sampled token;
        and ``no_loss``: the rows of those and of every episode whose environment failed."""
        items: list[Any] = []
        no_loss = []
        for outcome in outcomes:
            started = outcome.episode is not None and any(outcome.episode.sampled)
            placeholder = _Placeholder([self.tokenizer.pad_token_id, self.eos_ids[0]])
            items.append(outcome if started else placeholder)
            no_loss.append(not started or outcome.error is not None)
        return Rollout.from_episodes(items, self.tokenizer), np.asarray(no_loss, dtype=bool)

    def sample(
        self, sampler: Any, records: list[dict[str, Any]], params: SamplingParams, seed: int
    ) -> Sample:
        """An iteration's episodes, laid out and scored (see the module docstring)."""
        outcomes = self.play(sampler, records, params, seed)
        rollout, no_loss = self.layout(outcomes)
        parts = sorted({part for outcome in outcomes for part in outcome.rewards})
        scored = ScoredBatch(
            total=[math.fsum(outcome.rewards.values()) for outcome in outcomes],
            parts={part: [o.rewards.get(part, 0.0) for o in outcomes] for part in parts},
        )
        return Sample(
            rollout=rollout,
            scored=scored,
            task_scores=np.asarray(scored.total, dtype=np.float64),
            penalty=np.zeros(len(outcomes)),
            truncated=np.asarray([outcome.truncated for outcome in outcomes], dtype=bool),
            no_loss=no_loss,
            metrics=episode_metrics(outcomes),
        )

    def judge(
        self,
        sampler: Any,
        prompts: PromptSet,
        rows: Sequence[int],
        params: SamplingParams,
        *,
        seed: int,
    ) -> Judged:
        """One episode per record of ``rows`` (a row may repeat: one episode each), each
        scored as validation scores it: correct when its reward (the parts summed) is >= 1.
        What :meth:`validate` and ``strop eval`` both count."""
        outcomes = self.play(sampler, prompts.records(rows), params, seed)
        totals = [math.fsum(outcome.rewards.values()) for outcome in outcomes]
        rollout, _ = self.layout(outcomes)
        decode = partial(self.tokenizer.decode, skip_special_tokens=False)
        samples = [
            {
                "prompt": decode(rollout.prompt_ids[k]),
                "response": decode(rollout.response_ids[k, : rollout.lengths[k]].tolist()),
                "extracted": extract_answer(rollout.response_texts[k]),
                "gold": prompts.golds[row],
                "reward": totals[k],
            }
            for k, row in enumerate(rows)
        ]
        return Judged(outcomes, [total >= 1.0 for total in totals], samples)

    def validate(
        self,
        sampler: Any,
        prompts: PromptSet,
        rows: Sequence[int],
        params: SamplingParams,
        wanted: int,
        *,
        seed: int,
    ) -> tuple[int, list[dict[str, Any]]]:
        """One episode per record of ``rows`` (:meth:`judge`): how many are correct, and
        the first ``wanted`` as the samples a validation logs (the opening, the rest of the
        episode with its chat markers, the answer extracted from the last turn, the
        record's answer, the reward)."""
        judged = self.judge(sampler, prompts, rows, params, seed=seed)
        return sum(judged.correct), judged.samples[: max(wanted, 0)]


def add_trainer_reward(
    sample: Sample,
    reward: WeightedReward,
    prompts: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    golds: Mapping[str, Sequence[str]],
) -> Sample:
    """``sample``'s episodes scored by ``ppo.reward``'s weighted terms too: each term scores
    an episode's last model turn (``rollout.response_texts``: what a final-answer reward
    reads) with its record's columns (``prompts``, ``columns``, ``golds``: the rows'
    :meth:`~strop.rl.prompts.PromptSet.reward_inputs`), and the weighted sum is added to the
    environment's parts, as TRL sums ``reward_funcs`` with the environment's reward. Each
    term's own score is a part, logged as ``reward/<name>`` (weight 0 included), with the
    reward's counters; a row with no loss weight (its environment failed, or it never
    sampled a token) scores 0 there. A term named as a part of the environment is refused
    (:class:`ConfigError`): both would be ``reward/<name>``."""
    for component in reward.components:
        if component.name in sample.scored.parts:
            name = component.name
            raise ConfigError(
                f"ppo.reward's term {name!r} has the name of a reward part of the environment "
                f"(both would be reward/{name}); give the term another name: "
                f"{{reward: {component.reward.source or name}, weight: {component.weight:g}, "
                f"name: {name}_2}}"
            )
    before = reward.stats
    scored = reward.score(prompts, sample.rollout.response_texts, columns, golds)
    kept = [not dropped for dropped in sample.no_loss.tolist()]
    parts = {
        name: [score if keep else 0.0 for score, keep in zip(scores, kept, strict=True)]
        for name, scores in scored.parts.items()
    }
    total = [
        math.fsum((environment, trainer if keep else 0.0))
        for environment, trainer, keep in zip(sample.scored.total, scored.total, kept, strict=True)
    ]
    return dataclasses.replace(
        sample,
        scored=ScoredBatch(total, {**sample.scored.parts, **parts}),
        task_scores=np.asarray(total, dtype=np.float64),
        metrics={**sample.metrics, **(reward.stats - before).as_metrics()},
    )


@dataclass(frozen=True)
class Judged:
    """Episodes played for validation or ``strop eval``, in their rows' order: the outcomes,
    whether each is correct (reward >= 1), and each as a sample record."""

    outcomes: list[EpisodeOutcome]
    correct: list[bool]
    samples: list[dict[str, Any]]


@dataclass(frozen=True)
class _Placeholder:
    """The row of an episode with no sampled token: a one-token prompt and one token with
    no loss weight (:meth:`Episodes.layout` marks it ``no_loss``)."""

    ids: list[int]

    @property
    def turns(self) -> list[tuple[int, int]]:
        return [(len(self.ids) - 1, len(self.ids))]

    def columns(self) -> EpisodeColumns:
        n = len(self.ids)
        sampled = np.zeros(n, dtype=np.int8)
        sampled[-1] = 1
        return EpisodeColumns(np.asarray(self.ids, np.int32), sampled, np.zeros(n, np.float32))
