"""Preference data: records with a prompt, a chosen and a rejected answer -> token ids of the
shared prompt and of each answer.

Records come from the files SFT reads (:mod:`strop.data.sources`: JSONL; :mod:`strop.data
.tables`: Parquet, Arrow, a ``.json`` array, a ``datasets.save_to_disk`` directory), under
three keys (``prompt``, ``chosen``, ``rejected`` by default), in one of two shapes:

- text: the three are strings. The prompt is tokenized as SFT tokenizes a prompt (the
  tokenizer's prefix, e.g. BOS, then the text) and each answer as a completion (the text,
  then EOS), so ``prompt + answer`` needs its own leading space where one belongs.
- chat: the prompt is a list of turns (system, user, assistant, tool; ending in a user or
  tool turn) and each answer the assistant's reply to it: a string, or a list of turns
  whose last is the assistant's (TRL's conversational format ``[{"role": "assistant",
  "content": ...}]``). Answers that are whole conversations (UltraFeedback-binarized's
  ``chosen: [user, assistant]``) carry the prompt in the turns before their last, which
  must be the same in both; the prompt field is then not read. The chat template renders
  the prompt with its generation prompt; an answer is what the full chat adds to that (the
  reply and the template's end of turn), as :mod:`strop.data.sft` masks an assistant turn.

A text record without a prompt field (TRL's "implicit prompt", Anthropic HH-RLHF's
``chosen``/``rejected`` transcripts) carries its prompt as the answers' shared beginning:
:func:`split_shared_prompt` takes it as TRL's ``extract_prompt`` does (up to the first
character where the answers differ, a space before it going to the answers), and in a
``\n\nHuman: ... \n\nAssistant:`` transcript up to the last ``\n\nAssistant:`` the
answers share, so that each answer is the whole final reply.

Every piece is tokenized on its own and the ids concatenated, as SFT does. A record whose
answers are identical or empty (or whose prompt is), or malformed, is refused by
``file:line`` (``file:row`` for a table) when read; one whose prompt and longer answer
exceed ``max_length`` tokens when tokenized. With ``skip_bad_lines`` such records are
skipped, counted and named in one warning instead (an error still when none is left).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from strop.config import DataConfig
from strop.data.chat_records import _BadLine, _kind, _messages, _tools
from strop.data.record_files import check_text_size, read_records
from strop.data.sources import DEFAULT_MAX_RECORD_BYTES, ReadStats, _text
from strop.data.tokenizer import Tokenizer
from strop.errors import DataError, StropError

logger = logging.getLogger(__name__)

SKIP_HINT = "set data.skip_bad_lines=true to skip such records"


@dataclass(frozen=True)
class PreferenceExample:
    """One preference record: a text ``prompt`` or a chat prompt (``messages``, its
    ``tools``), and the two answers' texts (a chat's: the assistant's reply). ``source``
    and ``line`` say where it came from; ``columns`` is the record as read."""

    source: str
    line: int
    chosen: str
    rejected: str
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    columns: dict[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, eq=False)
class TokenizedPair:
    """A pair's token ids (``int32``): the shared prompt's, the chosen and the rejected
    answer's, with the file and line it came from. ``ids``: the three, for
    :func:`strop.batch.pairs.lay_out_pairs`."""

    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: np.ndarray
    source: str = ""
    line: int = 0

    @property
    def ids(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.prompt_ids, self.chosen_ids, self.rejected_ids

    def __len__(self) -> int:
        """The longer of its two rows (prompt + answer)."""
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


@dataclass
class PairStats:
    """What tokenizing did: pairs kept, pairs skipped (over the length limit, or answers
    that tokenize the same) and the first skip's reason, the kept pairs' prompt and answer
    tokens."""

    num_pairs: int = 0
    num_skipped: int = 0
    skipped_lines: list[int] = field(default_factory=list)
    first_skipped: str = ""
    num_prompt_tokens: int = 0
    num_answer_tokens: int = 0


def load_preference_pairs(
    path: str | Path, data: DataConfig, tokenizer: Tokenizer
) -> tuple[list[TokenizedPair], PairStats]:
    """The tokenized pairs of a data file as ``data`` says: its keys (``data.prompt_key``,
    default ``prompt``; ``data.chosen_key``, ``data.rejected_key``), ``data.max_length``,
    ``data.skip_bad_lines`` and ``data.max_record_bytes``."""
    examples, _ = read_preferences(
        path, prompt_key=data.prompt_key or "prompt", chosen_key=data.chosen_key,
        rejected_key=data.rejected_key, skip_bad_lines=data.skip_bad_lines,
        max_record_bytes=data.max_record_bytes,
    )  # fmt: skip
    return tokenize_preferences(
        examples, tokenizer, data.max_length, skip_bad_lines=data.skip_bad_lines
    )


def read_preferences(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    skip_bad_lines: bool = False,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> tuple[list[PreferenceExample], ReadStats]:
    """Every preference record of a data file; a bad one raises DataError naming
    ``path:line`` (``path:row``), or with ``skip_bad_lines`` is skipped and counted."""
    path = Path(path)
    keys = (prompt_key, chosen_key, rejected_key)

    def convert(record: dict[str, Any], number: int, table: bool) -> PreferenceExample:
        example = _to_pair(record, str(path), number, keys)
        if table:
            _check_size(example, max_record_bytes)
        return example

    read = read_records(
        path, convert, columns=dict.fromkeys(keys[1:]), skip_bad_lines=skip_bad_lines,
        max_record_bytes=max_record_bytes,
    )  # fmt: skip
    examples, skipped = read.items, read.skipped
    if not examples:
        what = (
            f"all {skipped} {read.unit}(s) are bad (first: {read.first_bad})"
            if skipped
            else "it is empty"
        )
        raise DataError(f"no preference pairs in {path}: {what}")
    return examples, ReadStats(str(path), "preferences", len(examples), skipped)  # type: ignore[arg-type]


def _to_pair(
    record: dict[str, Any], source: str, line: int, keys: tuple[str, str, str]
) -> PreferenceExample:
    prompt_key, chosen_key, rejected_key = keys
    for key in (chosen_key, rejected_key):
        if key not in record:
            raise _BadLine(f"missing field '{key}'; the record has {', '.join(sorted(record))}")
    chat = any(isinstance(record.get(key), list) for key in keys)
    if not chat and prompt_key not in record:
        prompt, chosen, rejected = split_shared_prompt(
            _text(record, chosen_key), _text(record, rejected_key)
        )
        if not prompt.strip():
            raise _BadLine(
                f"no field '{prompt_key}', and '{chosen_key}' and '{rejected_key}' share no "
                f"beginning to take as the prompt; give the prompt as '{prompt_key}' (or name "
                "its field with data.prompt_key)"
            )
        _check_answers(chosen, rejected, keys)
        return PreferenceExample(source, line, chosen, rejected, prompt=prompt, columns=record)
    if not chat:
        prompt = _text(record, prompt_key)
        if not prompt.strip():
            raise _BadLine(f"the prompt ('{prompt_key}') is empty")
        chosen, rejected = _text(record, chosen_key), _text(record, rejected_key)
        _check_answers(chosen, rejected, keys)
        return PreferenceExample(source, line, chosen, rejected, prompt=prompt, columns=record)
    chosen_turns, chosen = _reply(record, chosen_key)
    rejected_turns, rejected = _reply(record, rejected_key)
    if chosen_turns != rejected_turns:
        raise _BadLine(
            f"'{chosen_key}' and '{rejected_key}' differ before their last turn; a pair's "
            "answers reply to the same prompt"
        )
    if chosen_turns:
        turns = chosen_turns
    else:
        if prompt_key in record and not isinstance(record[prompt_key], list):
            raise _BadLine(
                f"field '{prompt_key}' must be a list of turns when the answers are turns, "
                f"got {_kind(record[prompt_key])}"
            )
        turns = _messages(record, prompt_key)
    if turns[-1]["role"] == "assistant":
        raise _BadLine(
            f"the prompt ends with an assistant turn, so the answers cannot be the reply to "
            f"it; end '{prompt_key}' with a user turn"
        )
    _check_answers(chosen, rejected, keys)
    return PreferenceExample(
        source, line, chosen, rejected, messages=turns, tools=_tools(record), columns=record
    )


HH_ASSISTANT = "\n\nAssistant:"
"""Where an assistant turn starts in an Anthropic HH-RLHF transcript."""


def split_shared_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """``(prompt, chosen answer, rejected answer)`` of two answers that begin with their
    prompt (an "implicit prompt"): the prompt is their shared beginning, up to the first
    character where they differ, a space just before it going to the answers (TRL's
    ``extract_prompt``); in an HH-RLHF transcript, up to the end of the last
    ``\n\nAssistant:`` they share, so each answer is the whole reply."""
    end = next(
        (i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b),
        min(len(chosen), len(rejected)),
    )
    if end > 0 and chosen[end - 1] == " ":
        end -= 1
    turn = chosen.rfind(HH_ASSISTANT, 0, end)
    if turn >= 0:
        end = turn + len(HH_ASSISTANT)
    return chosen[:end], chosen[end:], rejected[end:]


def _reply(record: dict[str, Any], key: str) -> tuple[tuple[dict[str, Any], ...], str]:
    """An answer as ``(the turns before the reply, the reply's text)``: a string is a reply
    with no turns before it; a list ends with the assistant's turn."""
    value = record[key]
    if isinstance(value, str):
        return (), value
    if not isinstance(value, list) or not value:
        raise _BadLine(f"field '{key}' must be a string or a non-empty list of turns")
    last = value[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise _BadLine(f"the last turn of '{key}' must be an assistant turn")
    if last.get("tool_calls"):
        raise _BadLine(f"the last turn of '{key}' calls tools; an answer is text")
    if not isinstance(last.get("content"), str):
        raise _BadLine(f"{key}[{len(value) - 1}].content must be a string")
    before = _messages({key: value[:-1]}, key) if len(value) > 1 else ()
    return before, last["content"]


def _check_answers(chosen: str, rejected: str, keys: tuple[str, str, str]) -> None:
    for key, text in zip(keys[1:], (chosen, rejected), strict=True):
        if not text.strip():
            raise _BadLine(f"the answer '{key}' is empty")
    if chosen == rejected:
        raise _BadLine(f"'{keys[1]}' and '{keys[2]}' are the same answer; a pair needs two")


def _check_size(example: PreferenceExample, max_record_bytes: int) -> None:
    texts = [example.prompt or "", example.chosen, example.rejected]
    check_text_size(texts + [json.dumps(turn) for turn in example.messages or ()], max_record_bytes)


def tokenize_preferences(
    examples: list[PreferenceExample],
    tokenizer: Tokenizer,
    max_length: int,
    *,
    skip_bad_lines: bool = False,
) -> tuple[list[TokenizedPair], PairStats]:
    """Each example's prompt, chosen and rejected ids. A pair whose prompt and longer
    answer exceed ``max_length`` tokens is refused by file and line (with
    ``skip_bad_lines``: skipped, counted and named in one warning)."""
    pieces = [_pieces(example, tokenizer) for example in examples]
    encoded = iter(tokenizer.encode_batch([text for piece in pieces for text in piece[1]]))
    eos = [tokenizer.eos_token_id]
    pairs: list[TokenizedPair] = []
    stats = PairStats()
    for example, (prefix, _, with_eos) in zip(examples, pieces, strict=True):
        prompt, chosen, rejected = (next(encoded) for _ in range(3))
        prompt = prefix + prompt
        if with_eos:  # a completion ends with EOS; a chat answer with the template's end of turn
            chosen, rejected = chosen + eos, rejected + eos
        length = len(prompt) + max(len(chosen), len(rejected))
        where = f"{example.source}:{example.line}"
        if chosen == rejected:
            bad = f"{where}: the two answers tokenize the same; a pair needs two different answers"
        elif length > max_length:
            bad = (
                f"{where}: the pair has {length} tokens (the prompt and its longer answer), "
                f"more than data.max_length={max_length}; raise data.max_length or {SKIP_HINT}"
            )
        else:
            bad = ""
        if bad:
            if not skip_bad_lines:
                raise DataError(bad)
            stats.num_skipped += 1
            stats.skipped_lines.append(example.line)
            stats.first_skipped = stats.first_skipped or bad.split(";")[0]
            continue
        pairs.append(
            TokenizedPair(
                np.asarray(prompt, np.int32),
                np.asarray(chosen, np.int32),
                np.asarray(rejected, np.int32),
                example.source,
                example.line,
            )
        )
        stats.num_prompt_tokens += len(prompt)
        stats.num_answer_tokens += len(chosen) + len(rejected)
    stats.num_pairs = len(pairs)
    if stats.num_skipped:
        if not pairs:
            raise DataError(
                f"no usable preference pair in {examples[0].source}: all {stats.num_skipped} "
                f"are bad (first: {stats.first_skipped})"
            )
        lines = stats.skipped_lines
        listed = ", ".join(map(str, lines[:10])) + ", ..." * (len(lines) > 10)
        logger.warning(
            "%s: skipped %d of %d pairs (lines %s; first: %s)",
            examples[0].source, len(lines), len(examples), listed, stats.first_skipped,
        )  # fmt: skip
    return pairs, stats


def _pieces(example: PreferenceExample, tokenizer: Tokenizer) -> tuple[list[int], list[str], bool]:
    """``(prefix ids, [prompt, chosen, rejected] texts, whether the answers end with EOS)``."""
    if example.messages is None:
        assert example.prompt is not None
        texts = [example.prompt, example.chosen, example.rejected]
        return list(tokenizer.special_prefix_ids), texts, True
    where = f"{example.source}:{example.line}"

    def render(turns, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(turns, generation_prompt, example.tools)
        except StropError as e:  # a template failure (DataError), no template (ModelError)
            raise type(e)(f"{where}: {e}") from None

    head = render(example.messages, True)
    texts = [head]
    for answer in (example.chosen, example.rejected):
        full = render([*example.messages, {"role": "assistant", "content": answer}], False)
        if not full.startswith(head):
            raise DataError(
                f"{where}: the chat template does not render the prompt as the start of the "
                "chat with its answer (it rewrites earlier turns), so the answer's tokens "
                "cannot be told apart; use text prompts and answers instead"
            )
        texts.append(full[len(head) :])
    return [], texts, False
