"""Sampling a model's responses to prompts and scoring them: what PPO's validation
(:meth:`strop.rl.ppo.PpoLoop.validate`) and ``strop eval`` (:mod:`strop.commands.evaluation`) share,
and the reward model either may score with (:func:`build_reward_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strop.backends import get_backend
from strop.backends.base import ActorCritic, Policy, RewardModel
from strop.config import Config
from strop.data import Tokenizer
from strop.generation import Generation, SamplingParams
from strop.rewards import extract_answer


def build_reward_model(config: Config, directory: Path) -> RewardModel:
    """A ``model:DIR`` reward's model (``ppo.reward``, ``eval.reward``), built by the run's
    backend at its first score: what ``rewards.resolve``/``rewards.load`` get as
    ``build_model``, over the run's config (``functools.partial``)."""
    return get_backend(config.backend).build_reward_model(config, directory)


@dataclass(frozen=True)
class Scored:
    """Responses to a batch of prompts: the generation, its decoded texts and their scores."""

    generation: Generation
    texts: list[str]
    scores: list[float]


def sample_and_score(
    model: Policy | ActorCritic,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    score: Callable[[list[str]], Sequence[float]],
    *,
    seed: int,
    eos_ids: Sequence[int],
    tokenizer: Tokenizer,
) -> Scored:
    """Sample one response to each of ``prompts`` from ``model`` (a ``Policy``, an
    ``ActorCritic`` or a rollout engine: its ``generate``) and score the decoded texts
    with ``score(texts)``."""
    generation = model.generate(
        list(prompts), params, seed=seed, eos_ids=eos_ids, pad_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
    )  # fmt: skip
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in generation.responses()]
    return Scored(generation, texts, [float(s) for s in score(texts)])


def sample_records(
    prompts: Sequence[str], scored: Scored, golds: Sequence[Any], count: int
) -> list[dict[str, Any]]:
    """The first ``count`` of a scored batch as the records a validation logs
    (:meth:`strop.metrics.MetricsWriter.write_samples`): prompt, response, the answer the
    math rules extract from it, the gold and the reward."""
    return [
        {
            "prompt": prompts[i],
            "response": scored.texts[i],
            "extracted": extract_answer(scored.texts[i]),
            "gold": golds[i],
            "reward": scored.scores[i],
        }
        for i in range(min(count, len(scored.texts)))
    ]
