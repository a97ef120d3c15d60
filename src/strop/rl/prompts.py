"""The prompts PPO samples from: token ids, gold answers and texts, read from a data file.

Prompts longer than ``data.max_length`` tokens are dropped and logged (or, with
``data.truncation=error``, refused by file and line); a prompt is never cut. Responses
are bounded separately, by ``generation.max_new_tokens``. A record with no gold answer for
a component of ``ppo.reward`` that needs one is refused by file and line (skipped with
``data.skip_bad_lines=true``); see :func:`strop.data.prompts.gold_answers`. This runs
after the tokenizer loads and before any model does.

What a reward function gets besides the prompts and completions (:meth:`PromptSet.reward_inputs`):
every column of the records (:func:`record_columns`), and for each component with a gold
rule its extracted golds as ``answer``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strop import rewards
from strop.config import Config, DataConfig
from strop.data import Tokenizer, read_data_file
from strop.data.prompts import answer_text, gold_answers, prompt_ids
from strop.data.sources import Example
from strop.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptSet:
    """Prompts (token ids), their gold answers and texts, read from a data file.

    ``golds`` is the ``answer`` column of the reward's first component (its extracted gold,
    or the record's answer text); ``columns`` every column of the records
    (:func:`record_columns`); ``golds_of`` the extracted golds of each component with a
    gold rule, by component name.
    """

    ids: list[list[int]]
    golds: list[str]
    texts: list[str]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    golds_of: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def read(
        cls,
        path: str,
        config: Config,
        tokenizer: Tokenizer,
        limit: int = 0,
        reward: rewards.WeightedReward | None = None,
    ) -> PromptSet:
        """Read ``path`` for ``reward`` (default: ``ppo.reward`` resolved)."""
        if reward is None:
            reward = rewards.resolve(config.ppo.reward, setting="ppo.reward")
        examples, _ = read_data_file(path, config.data)
        golds_of: dict[str, dict[int, str]] = {}  # component -> id(example) -> gold
        for component in reward.components:
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
        examples, ids = _within_max_length(examples, ids, config.data)
        if not examples:
            raise ConfigError(f"{path}: no prompts to train or validate on")
        columns = record_columns(examples)
        reward.check_call(columns)
        with_gold = [c.name for c in reward.components if c.reward.gold is not None]
        return cls(
            ids=ids,
            golds=[golds_of[reward.primary.name][id(example)] for example in examples],
            texts=[example.prompt or "" for example in examples],
            columns=columns,
            golds_of={name: [golds_of[name][id(e)] for e in examples] for name in with_gold},
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


# Passed positionally to every reward function; a record column of that name is not passed.
_POSITIONAL = ("prompts", "completions")


def record_columns(examples: Sequence[Example]) -> dict[str, list[Any]]:
    """The columns reward functions get for ``examples``: every key of the records as read
    (None where a record lacks it), aligned with ``examples``. ``answer`` is the record's
    own ``answer`` if it has one, else its answer text (the completion, or a chat's last
    assistant turn; "" if none); a component with a gold rule gets its extracted gold
    there instead. Columns named ``prompts`` or ``completions`` are left out: those
    arguments are the prompt texts and the responses."""
    records = [example.columns or {} for example in examples]
    keys = dict.fromkeys(key for record in records for key in record)
    columns = {k: [r.get(k) for r in records] for k in keys if k not in _POSITIONAL}
    columns["answer"] = [
        r["answer"] if "answer" in r else (answer_text(e) or "")
        for e, r in zip(examples, records, strict=True)
    ]
    return columns


def _within_max_length(
    examples: list[Example], ids: list[list[int]], data: DataConfig
) -> tuple[list[Example], list[list[int]]]:
    """Drop (and log) prompts longer than ``data.max_length`` tokens, or with
    ``data.truncation=error`` refuse the first one by file and line. A prompt is never cut:
    half a question has no right answer to reward."""
    kept = [i for i, prompt in enumerate(ids) if len(prompt) <= data.max_length]
    if len(kept) == len(ids):
        return examples, ids
    long = [i for i in range(len(ids)) if len(ids[i]) > data.max_length]
    first = examples[long[0]]
    where = f"{first.source}:{first.line}: the prompt has {len(ids[long[0]])} tokens"
    if data.truncation == "error":
        raise DataError(
            f"{where}, more than data.max_length={data.max_length}; raise data.max_length, or "
            "set data.truncation to right or left to drop such prompts"
        )
    lines = ", ".join(str(examples[i].line) for i in long[:10]) + (", ..." * (len(long) > 10))
    logger.warning(
        "%s: dropped %d of %d prompts longer than data.max_length=%d tokens (lines %s)",
        first.source, len(long), len(ids), data.max_length, lines,
    )  # fmt: skip
    return [examples[i] for i in kept], [ids[i] for i in kept]
