"""A reward model's input rows: what both backends' reward models read.

Text: the reward model's own tokenizer; with a chat template, the conversation
``[user: prompt, assistant: response]`` rendered by it; without one, prompt + response
(with the tokenizer's special prefix, e.g. BOS, as ``transformers`` would add).

Score: the score head on the hidden state of the last token that is not
``pad_token_id`` (of the model's config.json), as ``transformers``'
``...ForSequenceClassification`` pools; with no ``pad_token_id``, the last token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def encode_pairs(tokenizer, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
    """The reward model's token ids of each (prompt, completion): through its chat template
    when it has one, else the plain concatenation after its special prefix."""
    if tokenizer.chat_template is not None:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            )
            for p, c in zip(prompts, completions, strict=True)
        ]
        return tokenizer.encode_batch(texts)
    prefix = tokenizer.special_prefix_ids
    texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    return [prefix + ids for ids in tokenizer.encode_batch(texts)]


def pooled_index(ids: Sequence[int], pad_id: int | None) -> int:
    """The column whose hidden state is scored: the last token that is not ``pad_id``
    (0 if every token is), as transformers pools; the last token without a ``pad_id``."""
    if pad_id is None:
        return len(ids) - 1
    real = np.flatnonzero(np.asarray(ids) != pad_id)
    return int(real[-1]) if len(real) else 0


def right_padded(
    rows: Sequence[Sequence[int]], width: int, count: int, fill: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` ``[count, width]`` int32: ``rows`` right-padded, then empty rows."""
    ids = np.full((count, width), fill, np.int32)
    mask = np.zeros((count, width), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask
