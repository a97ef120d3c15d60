"""The records' own completions as a rollout engine: GKD's off-policy iterations.

With ``distill.lmbda`` < 1 some iterations of ``strop distill`` train on the records'
completions instead of the student's samples (Agarwal et al. 2024, GKD: ``lambda`` is the
student's share). :class:`RecordCompletions` answers each prompt with its record's
completion, as SFT tokenizes it (:func:`strop.data.sft.completion_ids`), cut at
``generation.max_new_tokens``, so the rest of the iteration (scoring, the layout, the
update) is the same as on sampled responses. Its "log-probabilities" are zeros: nothing
sampled them, and only a divergence's update (which reads none) trains on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strop.data import Tokenizer
from strop.data.sft import completion_ids
from strop.errors import DataError
from strop.generation import Decoding, Generation, Sampler, SamplingParams
from strop.rl.prompts import PromptSet


def use_records(seed: int, step: int, lmbda: float) -> bool:
    """Whether iteration ``step`` trains on the records' completions (a seeded draw, so a
    resumed run draws what an uninterrupted one did): with probability ``1 - lmbda``."""
    return lmbda < 1.0 and np.random.default_rng([seed, step, 4807]).random() >= lmbda


@dataclass
class RecordCompletions(Sampler):
    """A rollout engine whose response to a prompt is its record's completion (a
    :class:`~strop.generation.Sampler`: ``generate`` is the samplers' own)."""

    completions: dict[tuple[int, ...], list[int]]
    stale: bool = field(default=False, init=False)

    @classmethod
    def of(cls, prompts: PromptSet, tokenizer: Tokenizer, source: str) -> RecordCompletions:
        """The completions of ``prompts``' records; a :class:`DataError` (one line) when
        none has one."""
        completions = {}
        for example, ids in zip(prompts.examples, prompts.ids, strict=True):
            completion = completion_ids(example, tokenizer, ids)
            if completion is not None:
                completions[tuple(ids)] = completion
        if not completions:
            raise DataError(
                f"{source}: no record has a completion (an answer, or a chat's last "
                "assistant turn) for distill.lmbda < 1 to train on: give such records, or "
                "set distill.lmbda=1"
            )
        return cls(completions)

    def sample(
        self, prompts: list[list[int]], params: SamplingParams, decoding: Decoding
    ) -> Generation:
        """Each prompt's record completion, cut at ``params.max_new_tokens`` (a prompt whose
        record has none gets an empty response: left out of the losses)."""
        eos_ids, pad_id = decoding.eos_ids, decoding.pad_id
        rows = [self.completions.get(tuple(p), [])[: params.max_new_tokens] for p in prompts]
        width = max(max(len(row) for row in rows), 1)
        tokens = np.full((len(rows), width), pad_id, np.int32)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
        ends = set(eos_ids)
        finish = ["stop" if row and row[-1] in ends else "length" for row in rows]
        lengths = np.array([len(row) for row in rows], np.int32)
        return Generation(tokens, np.zeros(tokens.shape, np.float32), lengths, finish)

    def mark_stale(self) -> None:
        self.stale = True  # nothing to refresh: the records do not change

    def metrics(self) -> dict[str, float]:
        return {}
