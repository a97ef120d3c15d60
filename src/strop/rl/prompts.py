"""The prompts PPO samples from: token ids, gold answers and texts, read from a data file.

Prompts longer than ``data.max_length`` tokens are dropped and logged (or, with
``data.truncation=error``, refused by file and line); a prompt is never cut. Responses
are bounded separately, by ``generation.max_new_tokens``. A record with no gold answer for
``ppo.reward`` is refused by file and line (skipped with ``data.skip_bad_lines=true``); see
:func:`strop.data.prompts.gold_answers`. This runs after the tokenizer loads and before
any model does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from strop import rewards
from strop.config import Config, DataConfig
from strop.data import Tokenizer, read_data_file
from strop.data.prompts import gold_answers, prompt_ids
from strop.data.sources import Example
from strop.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptSet:
    """Prompts (token ids), their gold answers and texts, read from a data file."""

    ids: list[list[int]]
    golds: list[str]
    texts: list[str]

    @classmethod
    def read(cls, path: str, config: Config, tokenizer: Tokenizer, limit: int = 0) -> PromptSet:
        examples, _ = read_data_file(path, config.data)
        examples, golds = gold_answers(
            examples,
            rewards.get(config.ppo.reward),
            setting="ppo.reward",
            skip_bad_lines=config.data.skip_bad_lines,
        )
        gold_of = {id(example): gold for example, gold in zip(examples, golds, strict=True)}
        if limit:
            examples = examples[:limit]
        ids = [prompt_ids(example, tokenizer) for example in examples]
        examples, ids = _within_max_length(examples, ids, config.data)
        if not examples:
            raise ConfigError(f"{path}: no prompts to train or validate on")
        return cls(
            ids=ids,
            golds=[gold_of[id(example)] for example in examples],
            texts=[example.prompt or "" for example in examples],
        )

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def longest(self) -> int:
        """Tokens in the longest prompt."""
        return max(len(ids) for ids in self.ids)

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
