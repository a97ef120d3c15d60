"""What a PPO run is made of besides its models, read once from the config (``strop ppo``).

:meth:`PpoRun.read` runs once the job's preflight passed and its run directory is held,
before any model loads: the tokenizer and the ids that end a response, the environment's
episodes (``env.name``), the training prompts and the held-out ones (``data.eval_path``,
when ``ppo.validate_every`` asks for validation), a context check of the longest prompt
against the model's positions, and the run's role plan (:class:`~strop.objectives.roles.RolePlan`:
which roles it has, and what each update trains). The loop (:class:`strop.rl.ppo.PpoLoop`)
and the backend's ``build_actor_critic`` take what they need from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from strop import rewards
from strop.config import Config
from strop.data import Tokenizer, policy_tokenizer
from strop.io.model_spec import check_context_length, response_end_ids
from strop.objectives.roles import RolePlan
from strop.rl.episodes import Episodes
from strop.rl.prompts import PromptSet

if TYPE_CHECKING:
    from strop.run.preflight import RunFacts


@dataclass(frozen=True)
class PpoRun:
    """A PPO run's tokenizer, prompts, episodes and role plan (see the module's docstring).

    ``longest``: the most tokens a prompt the model samples after can have (the longest
    prompt of both sets; with episodes, the longest prefix a turn is sampled after): what
    a backend that compiles each shape pads to (``expect_prompts``), and the longest
    prompt the rollout engine serves."""

    tokenizer: Tokenizer
    eos_ids: list[int]
    episodes: Episodes | None
    train: PromptSet
    validation: PromptSet | None
    longest: int
    plan: RolePlan

    @classmethod
    def read(
        cls,
        config: Config,
        reward: rewards.WeightedReward | None,
        facts: RunFacts,
    ) -> PpoRun:
        """Read the run's inputs (``reward``: the resolved ``ppo.reward``, or None; with
        ``env.name`` the environment scores the episodes, with the factory preflight built
        once, as it read the model's spec and the role plan: ``facts``); what they
        refuse is one line (:class:`~strop.errors.StropError`), before any model loads."""
        ppo = config.ppo
        spec, plan = facts.model_spec(config), facts.roles
        assert plan is not None  # a PPO run has roles
        tokenizer = policy_tokenizer(config)
        stops = response_end_ids(spec, tokenizer.eos_token_id)
        episodes = Episodes.from_config(config, tokenizer, stops, facts.environment)
        train = PromptSet.read(config.data.train_path, config, tokenizer, reward=reward)
        validation = None
        if config.data.eval_path and ppo.validate_every:
            validation = PromptSet.read(
                config.data.eval_path, config, tokenizer, ppo.validation_size, reward=reward
            )
        longest = max(train.longest, validation.longest if validation is not None else 0)
        check_context_length(  # before the weights load
            spec, config.model_path(), samples=True, prompts_cut_at_max_length=True,
            max_length=config.data.max_length, max_new_tokens=config.generation.max_new_tokens,
            longest_prompt=longest,
            max_episode_tokens=config.env.max_episode_tokens if episodes else None,
        )  # fmt: skip
        if episodes is not None:  # a turn is sampled after up to env.max_episode_tokens - 1
            longest = episodes.longest_prefix
        return cls(tokenizer, stops, episodes, train, validation, longest, plan)
