"""Examples -> the prompt a model is asked to continue, and the answer it should reach.

The prompt is tokenized exactly as in training (``data/sft.py``): the tokenizer's prefix
(e.g. BOS) + the prompt text for prompt/completion and GSM8K records; for chats, every
turn before the last assistant turn rendered with the chat template and its generation
prompt. So evaluation and RL see the prompts SFT trained on.
"""

from __future__ import annotations

from strop.data.sources import Example
from strop.data.tokenizer import Tokenizer
from strop.errors import DataError


def prompt_ids(example: Example, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the prompt of ``example`` (what generation continues)."""
    if example.messages is not None:
        turns = list(example.messages)
        if turns and turns[-1]["role"] == "assistant":
            turns = turns[:-1]
        if not turns:
            raise DataError(f"{example.source}:{example.line}: the chat has no prompt turns")
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        return tokenizer.encode(text)
    assert example.prompt is not None
    return list(tokenizer.special_prefix_ids) + tokenizer.encode(example.prompt)


def gold_answer(example: Example) -> str:
    """The reference the response is scored against: a GSM8K record's final answer, else
    the completion or last assistant turn (a reward extracts what it needs from it)."""
    if example.reference is not None:
        return example.reference
    if example.completion is not None:
        return example.completion
    if example.messages and example.messages[-1]["role"] == "assistant":
        return example.messages[-1]["content"]
    raise DataError(f"{example.source}:{example.line}: no reference answer to score against")
