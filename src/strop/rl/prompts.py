"""The prompts PPO samples from: token ids, gold answers and texts, read from a data file.

Prompts longer than ``data.max_length`` tokens are dropped and logged (or, with
``data.truncation=error``, refused by file and line); a prompt is never cut. Responses
are bounded separately, by ``generation.max_new_tokens``. A record with no gold answer for
a component of ``ppo.reward`` that needs one is refused by file and line (skipped with
``data.skip_bad_lines=true``); see :func:`strop.data.prompts.gold_answers`. This runs
after the tokenizer loads and before any model does.

What a reward function gets besides the prompts and completions (:meth:`PromptSet.reward_inputs`):
every column of the records (:func:`~strop.data.prompts.record_columns`), and for each component with a gold
rule its extracted golds as ``answer``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strop import rewards
from strop.config import Config
from strop.data import Tokenizer, read_data_file
from strop.data.prompts import gold_answers, prompt_ids, record_columns, within_max_length
from strop.data.sources import Example
from strop.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptSet:
    """Prompts (token ids), their gold answers and texts, read from a data file.

    ``golds`` is the ``answer`` column of the reward's first component (its extracted gold,
    or the record's answer text); ``columns`` every column of the records
    (:func:`~strop.data.prompts.record_columns`); ``golds_of`` the extracted golds of each component with a
    gold rule, by component name.
    """

    ids: list[list[int]]
    golds: list[str]
    texts: list[str]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    golds_of: dict[str, list[str]] = field(default_factory=dict)
    examples: list[Example] = field(default_factory=list)  # the records, as read and kept

    @classmethod
    def read(
        cls,
        path: str,
        config: Config,
        tokenizer: Tokenizer,
        limit: int = 0,
        reward: rewards.WeightedReward | None = None,
    ) -> PromptSet:
        """Read ``path`` for ``reward`` (default: ``ppo.reward`` resolved); with ``env.name``
        no reward: the records go to the environment as they are (``golds``: their
        ``answer`` column, for the logged samples)."""
        episodes = config.env.enabled
        if reward is None and not episodes:
            reward = rewards.resolve(config.ppo.reward, setting="ppo.reward")
        # With episodes the environment decides what an answer is: no GSM8K '#### ' check.
        examples, _ = read_data_file(path, config.data, gsm8k_golds=not episodes)
        golds_of: dict[str, dict[int, str]] = {}  # component -> id(example) -> gold
        for component in reward.components if reward is not None else ():
            if component.reward.gold is not None or component is reward.primary:
                examples, golds = gold_answers(
                    examples,
                    component.reward,
                    setting="ppo.reward",
                    skip_bad_lines=config.data.skip_bad_lines,
                )
                golds_of[component.name] = {id(e): g for e, g in zip(examples, golds, strict=True)}
        if limit:
            examples = examples[:limit]
        ids = [prompt_ids(example, tokenizer) for example in examples]
        examples, ids = within_max_length(examples, ids, config.data)
        if not examples:
            raise ConfigError(f"{path}: no prompts to train or validate on")
        columns = record_columns(examples)
        texts = [example.prompt or "" for example in examples]
        if reward is None:
            return cls(ids, [str(a) for a in columns["answer"]], texts, columns, examples=examples)
        reward.check_call(columns)
        with_gold = [c.name for c in reward.components if c.reward.gold is not None]
        return cls(
            ids=ids,
            golds=[golds_of[reward.primary.name][id(example)] for example in examples],
            texts=texts,
            columns=columns,
            golds_of={name: [golds_of[name][id(e)] for e in examples] for name in with_gold},
            examples=examples,
        )

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def longest(self) -> int:
        """Tokens in the longest prompt."""
        return max(len(ids) for ids in self.ids)

    def reward_inputs(
        self, rows: Sequence[int]
    ) -> tuple[list[str], dict[str, list[Any]], dict[str, list[str]]]:
        """Prompt texts, record columns and golds by component of ``rows``: the arguments of
        :meth:`~strop.rewards.WeightedReward.score` besides the completions."""
        columns = self.columns or {"answer": self.golds}
        return (
            [self.texts[i] for i in rows],
            {key: [values[i] for i in rows] for key, values in columns.items()},
            {name: [golds[i] for i in rows] for name, golds in self.golds_of.items()},
        )

    def records(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        """The records of ``rows`` as read (every column; ``answer`` as rewards get it):
        what an environment's ``reset`` gets."""
        return [{key: values[i] for key, values in self.columns.items()} for i in rows]

    def draw(self, step: int, count: int, seed: int) -> list[int]:
        """Indices of the ``count`` prompts of iteration ``step``: consecutive slices of a
        permutation that is reshuffled (seeded) for every pass over the data."""
        out: list[int] = []
        position = step * count
        while len(out) < count:
            epoch, offset = divmod(position, len(self))
            order = np.random.default_rng([seed, epoch]).permutation(len(self))
            take = min(count - len(out), len(self) - offset)
            out.extend(int(i) for i in order[offset : offset + take])
            position += take
        return out
