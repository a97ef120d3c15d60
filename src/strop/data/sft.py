"""Examples -> token ids and loss masks for supervised fine-tuning.

Alignment: index t of every per-token array refers to token ``x_t``; ``loss_mask[t] = 1``
means ``x_t`` is a target, predicted from the logits at position ``t - 1``. So
``loss_mask[0]`` is always 0 (nothing predicts the first token).

- prompt/completion (and gsm8k): ``prefix + prompt + completion + [eos]``, where ``prefix``
  is what the tokenizer's post-processor puts before a sequence (e.g. Llama's BOS, nothing
  for Qwen2). Loss on the completion tokens and the EOS.
- messages: the chat template is rendered on prefixes of the conversation. For assistant
  turn i, ``render(messages[:i], add_generation_prompt=True)`` ends with the assistant header
  and ``render(messages[:i + 1])`` continues it with the turn; the difference (the turn's
  content and the template's end-of-turn text, e.g. ``"...<|im_end|>\\n"``) gets loss, the
  rest does not. No EOS is appended: the template's end-of-turn token is what the model
  learns to stop with. Templates that rewrite earlier turns when the chat grows (so a
  prefix's rendering is not a prefix of the whole) are rejected. Tool use trains the same
  way: an assistant turn's ``tool_calls`` are rendered by the template (with the record's
  ``tools``) and get loss, ``tool`` turns (results) do not.

Every segment is tokenized on its own and the ids concatenated: that sequence, not a
re-tokenization of the joined text, is what is trained on, so the mask boundary is exact.
At boundaries on special tokens or newlines (ChatML, Llama 3) both are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from strop.data.sources import Example
from strop.data.tokenizer import Tokenizer
from strop.errors import ConfigError, DataError, StropError

Truncation = Literal["right", "left", "error"]
Segment = tuple[str, int]  # (text, loss flag)


@dataclass(frozen=True, eq=False)
class TokenizedExample:
    """One training sequence: ``input_ids [T] int32`` and ``loss_mask [T] uint8`` (0/1,
    ``loss_mask[0] == 0``), with the file and 1-based line it came from."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    source: str = ""
    line: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class TokenizeStats:
    """Counts from tokenizing a data set: kept examples, truncated ones, dropped ones (no
    loss token left after truncation), and tokens kept in all / with loss."""

    num_examples: int = 0
    num_truncated: int = 0
    num_dropped: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    dropped_lines: list[int] = field(default_factory=list)


def tokenize_examples(
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    max_length: int,
    truncation: Truncation = "right",
) -> tuple[list[TokenizedExample], TokenizeStats]:
    """Tokenize and mask every example, truncate to ``max_length`` tokens, and drop (and
    count) those left without a loss token."""
    if max_length < 2:
        raise ConfigError(f"data.max_length must be at least 2 tokens, got {max_length}")
    plans = [_plan(example, tokenizer) for example in examples]
    texts = [text for _, segments, _ in plans for text, _ in segments]
    encoded = iter(tokenizer.encode_batch(texts))

    out: list[TokenizedExample] = []
    stats = TokenizeStats()
    for example, (prefix, segments, suffix) in zip(examples, plans, strict=True):
        pieces = [np.asarray(prefix, dtype=np.int32)]
        flags = [np.zeros(len(prefix), dtype=np.uint8)]
        for _, flag in segments:
            ids = np.asarray(next(encoded), dtype=np.int32)
            pieces.append(ids)
            flags.append(np.full(len(ids), flag, dtype=np.uint8))
        pieces.append(np.asarray(suffix, dtype=np.int32))
        flags.append(np.ones(len(suffix), dtype=np.uint8))
        input_ids, loss_mask = np.concatenate(pieces), np.concatenate(flags)

        if len(input_ids) > max_length:
            if truncation == "error":
                raise DataError(
                    f"{example.source}:{example.line}: the example has {len(input_ids)} tokens, "
                    f"more than data.max_length={max_length}; raise data.max_length or set "
                    "data.truncation to right or left"
                )
            keep = slice(0, max_length) if truncation == "right" else slice(-max_length, None)
            input_ids, loss_mask = input_ids[keep].copy(), loss_mask[keep].copy()
            stats.num_truncated += 1
        if len(loss_mask):
            loss_mask[0] = 0  # no logits predict the first token
        if not loss_mask.any():
            stats.num_dropped += 1
            stats.dropped_lines.append(example.line)
            continue
        out.append(TokenizedExample(input_ids, loss_mask, example.source, example.line))
        stats.num_tokens += len(input_ids)
        stats.num_loss_tokens += int(loss_mask.sum())
    stats.num_examples = len(out)
    return out, stats


def _plan(example: Example, tokenizer: Tokenizer) -> tuple[list[int], list[Segment], list[int]]:
    """(prefix ids, text segments with loss flags, suffix ids) of one example."""
    if example.messages is not None:
        return [], chat_segments(example, tokenizer), []
    if example.completion is None:  # a record read by data.prompt_key with no answer_key
        raise DataError(
            f"{example.source}:{example.line}: the record has no completion to train on; "
            "set data.answer_key to the column of the answer"
        )
    assert example.prompt is not None
    segments = [(example.prompt, 0), (example.completion, 1)]
    return list(tokenizer.special_prefix_ids), segments, [tokenizer.eos_token_id]


def chat_segments(example: Example, tokenizer: Tokenizer) -> list[Segment]:
    """The rendered chat of ``example.messages`` cut into (text, 1 for assistant turns else
    0) pieces whose concatenation is the whole rendered chat."""
    messages, tools = example.messages or (), example.tools
    where = f"{example.source}:{example.line}"
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(
            f"{where}: the chat has no assistant turn, so there is nothing to learn from it "
            "(SFT trains on assistant turns); add the assistant's reply or drop the record"
        )

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:upto], generation_prompt, tools)
        except StropError as e:  # template failures (DataError), no template (ModelError)
            raise type(e)(f"{where}: {e}") from None

    segments: list[Segment] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = render(i, True)
        full = render(i + 1, False)
        if not (head.startswith(done) and full.startswith(head)):
            raise DataError(
                f"{where}: the chat template does not render the conversation up to turn {i} "
                "as a prefix of the longer conversation (it rewrites earlier turns), so the "
                "assistant tokens cannot be masked; use prompt/completion data, or set "
                "data.chat_template to a template that does (qwen3-training for Qwen3)"
            )
        segments += [(head[len(done) :], 0), (full[len(head) :], 1)]
        done = full
    whole = render(len(messages), False)
    if not whole.startswith(done):
        raise DataError(f"{where}: the chat template renders the last turns inconsistently")
    segments.append((whole[len(done) :], 0))
    return [(text, flag) for text, flag in segments if text]


def completion_ids(
    example: Example, tokenizer: Tokenizer, prompt: Sequence[int]
) -> list[int] | None:
    """The token ids a record's completion adds after its ``prompt`` ids (what generation
    continues; :func:`~strop.data.prompts.prompt_ids`), as SFT tokenizes it: its answer,
    or its chat's last assistant turn, then the end of the turn. None where the record has
    none, or where SFT's tokenization does not continue ``prompt`` with trained tokens only
    (a chat whose template renders its prompt otherwise when an answer follows)."""
    try:
        tokenized, _ = tokenize_examples([example], tokenizer, max_length=1 << 30)
    except DataError:  # no completion to train on
        return None
    if not tokenized:  # nothing to train on: no completion either
        return None
    ids, mask, cut = tokenized[0].input_ids, tokenized[0].loss_mask, len(prompt)
    if len(ids) <= cut or list(ids[:cut]) != list(prompt) or not mask[cut:].all():
        return None
    return [int(token) for token in ids[cut:]]
