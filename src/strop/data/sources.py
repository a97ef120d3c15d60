"""Data records -> examples, with errors that name the file and the 1-based line (or row).

A data path is a JSONL file (one JSON object per line; blank lines are ignored), or, read by
:mod:`strop.data.tables`, a Parquet or Arrow file, a directory written by
``datasets.save_to_disk``, or a ``.json`` file holding one array of objects. Formats:

- ``prompt_completion``: ``{"prompt": str, "completion": str}``
- ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str},
  ...], "tools": [...]}``. Tool use in the OpenAI / Hugging Face chat format: an assistant
  turn may carry ``tool_calls`` (``[{"type": "function", "function": {"name": str,
  "arguments": {...}}}]``; its ``content`` may then be empty or null), a ``tool`` turn
  (the result) a ``name``; the optional ``tools`` (JSON-schema dicts) go to the chat
  template as ``tools=``, as ``transformers``' ``apply_chat_template`` takes them.
- ``gsm8k``: ``{"question": str, "answer": str}``; the answer ends with ``#### <number>``.
  The prompt is ``prompt_template`` with ``{question}`` replaced; the completion is
  ``" " + answer`` and ``reference`` is the text after ``#### ``. With ``gsm8k_golds=False``
  (episodes: the environment decides what an answer is) the records are read by key
  instead: the answer is any string or number.
- ``auto``: the format of the first record that has the keys of one of the above.
- by key (``prompt_key`` set; format ``keys``): the prompt is ``record[prompt_key]``, a string
  (put into ``prompt_template``) or a chat (a list of role/content turns, rendered with the
  tokenizer's chat template); ``record[answer_key]`` (a string or a number; optional) is the
  completion (after a space) or, after a chat, an assistant turn: SFT trains on it, and a
  reward finds the gold in it (``#### 42``, ``\\boxed{...}``, a number). So MATH records
  read with ``prompt_key=problem answer_key=solution``.

Each line is parsed with ``json.loads`` and nothing else; a line longer than
``max_record_bytes`` is refused unread (tokenizing one 50 MB record took 9.8 GB, only for
truncation to cut it to ``data.max_length``). With ``skip_bad_lines`` a bad line
is skipped and counted (and a warning logged); a file with no good record is still an error.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from strop.data.chat_records import _BadLine, _kind, _messages, _tools
from strop.data.record_files import check_text_size, read_records
from strop.errors import ConfigError, DataError

if TYPE_CHECKING:
    from strop.config import DataConfig


Format = Literal["prompt_completion", "messages", "gsm8k", "keys"]
GSM8K_MARKER = "#### "
DEFAULT_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
DEFAULT_MAX_RECORD_BYTES = 4 << 20


@dataclass(frozen=True)
class Example:
    """One record: ``prompt`` + ``completion`` text, or a chat in ``messages``.

    ``source`` and ``line`` (1-based) say where it came from; ``reference`` is the final
    answer of a gsm8k record (for rewards and accuracy), else None; ``tools`` are a chat's
    tool schemas (the chat template's ``tools=``), else None. ``columns`` is the
    record as read (every key of its JSON object), which reward functions receive.
    """

    source: str
    line: int
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    reference: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    columns: dict[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ReadStats:
    """What reading a file found: its format, good records and skipped bad lines."""

    path: str
    format: Format
    num_records: int
    num_skipped: int


def read_examples(
    path: str | Path,
    format: Literal["auto", "prompt_completion", "messages", "gsm8k"] = "auto",
    *,
    skip_bad_lines: bool = False,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    gsm8k_golds: bool = True,
) -> tuple[list[Example], ReadStats]:
    """Read every record of a data file (JSONL, or a table :mod:`strop.data.tables` reads);
    raise DataError naming ``path:line`` (``path:row``) for a bad one. With ``prompt_key``
    every record is read by key (see the module docstring), whatever ``format`` says;
    ``gsm8k_golds=False`` reads gsm8k records by key (no ``#### `` answer required)."""
    path = Path(path)
    keys = _check_keys(prompt_key, answer_key)
    settings = ("data.prompt_key", "data.answer_key")
    columns = {k: s for k, s in zip(keys or (), settings, strict=False) if k is not None}
    fmt: Format | None = "keys" if keys else None if format == "auto" else format

    def convert(record: dict[str, Any], number: int, table: bool) -> Example:
        nonlocal fmt
        if fmt is None:
            fmt = detect_format(record)
        own = keys if fmt != "gsm8k" or gsm8k_golds else ("question", "answer")
        example = _to_example(record, fmt, str(path), number, prompt_template, own)
        if table:
            _check_size(example, max_record_bytes)
        return dataclasses.replace(example, columns=record)

    def explain(bad: _BadLine) -> str:
        if format == "auto" or keys or not str(bad).startswith("missing field"):
            return ""
        return (
            f" (data.format={format}, set by the recipe or an override, reads "
            f"{_FIELDS[format]} records; data.format=auto tells from the keys)"
        )

    read = read_records(
        path, convert, columns=columns, skip_bad_lines=skip_bad_lines,
        max_record_bytes=max_record_bytes, explain=explain,
    )  # fmt: skip
    examples, skipped, unit = read.items, read.skipped, read.unit
    if not examples:
        if skipped:
            raise DataError(
                f"no valid records in {path}: all {skipped} non-blank {unit}(s) are bad "
                f"(first: {read.first_bad})"
            )
        if read.table:
            raise DataError(f"data set {path} is empty (no records)")
        raise DataError(
            f"data file {path} is empty (no records); it needs one JSON object per line"
        )
    assert fmt is not None
    return examples, ReadStats(str(path), fmt, len(examples), skipped)


def read_data_file(
    path: str | Path, data: DataConfig, *, gsm8k_golds: bool = True
) -> tuple[list[Example], ReadStats]:
    """:func:`read_examples` of ``path`` as the run's ``data:`` section says (format, keys,
    skipping, prompt template, record size cap); ``gsm8k_golds`` as there."""
    return read_examples(
        path,
        data.format,
        gsm8k_golds=gsm8k_golds,
        skip_bad_lines=data.skip_bad_lines,
        prompt_template=data.prompt_template,
        max_record_bytes=data.max_record_bytes,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
    )


def _check_keys(prompt_key: str | None, answer_key: str | None) -> tuple[str, str | None] | None:
    """``(prompt_key, answer_key)`` when records are read by key (``data.format`` aside: a
    recipe's gsm8k does not stand in the way of a MATH file's keys), else None."""
    if prompt_key is None:
        if answer_key is not None:
            raise ConfigError(
                f"data.answer_key={answer_key} needs data.prompt_key, the column of the prompt"
            )
        return None
    return prompt_key, answer_key


def _check_size(example: Example, max_record_bytes: int) -> None:
    texts = [example.prompt or "", example.completion or ""]
    texts += [turn["content"] for turn in example.messages or ()]
    texts += [json.dumps(turn.get("tool_calls", "")) for turn in example.messages or ()]
    check_text_size(texts, max_record_bytes)


_FIELDS = {
    "prompt_completion": "'prompt'+'completion'",
    "messages": "'messages'",
    "gsm8k": "'question'+'answer'",
}


def detect_format(record: dict[str, Any]) -> Format:
    """The format whose keys a record has (messages, then prompt/completion, then gsm8k)."""
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "question" in record and "answer" in record:
        return "gsm8k"
    keys = ", ".join(sorted(record)) or "none"
    raise _BadLine(
        f"cannot tell the data format from the keys ({keys}); expected 'messages', "
        "'prompt'+'completion' or 'question'+'answer', or set data.format, or name the "
        "columns with data.prompt_key / data.answer_key"
    )


def _to_example(
    record: dict[str, Any],
    fmt: Format,
    source: str,
    line: int,
    prompt_template: str,
    keys: tuple[str, str | None] | None = None,
) -> Example:
    if keys is not None:
        return _keyed_example(record, source, line, prompt_template, *keys)
    if fmt == "prompt_completion":
        prompt, completion = _text(record, "prompt"), _text(record, "completion")
        return Example(source, line, prompt=prompt, completion=completion)
    if fmt == "gsm8k":
        question, answer = _text(record, "question"), _text(record, "answer")
        if GSM8K_MARKER not in answer:
            raise _BadLine(f"gsm8k answer has no final '{GSM8K_MARKER}<number>'")
        reference = answer.rsplit(GSM8K_MARKER, 1)[1].strip()
        if not reference:
            raise _BadLine(f"gsm8k answer has nothing after '{GSM8K_MARKER}'")
        prompt = prompt_template.replace("{question}", question)
        return Example(source, line, prompt=prompt, completion=" " + answer, reference=reference)
    return Example(source, line, messages=_messages(record), tools=_tools(record))


def _keyed_example(
    record: dict[str, Any],
    source: str,
    line: int,
    prompt_template: str,
    prompt_key: str,
    answer_key: str | None,
) -> Example:
    """A record read by key: its prompt (text or chat) and, with ``answer_key``, answer."""
    for setting, key in (("data.prompt_key", prompt_key), ("data.answer_key", answer_key)):
        if key is not None and key not in record:
            keys = ", ".join(sorted(record)) or "none"
            raise _BadLine(f"missing field '{key}' ({setting}); the record has {keys}")
    answer = None
    if answer_key is not None:
        value = record[answer_key]
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        answer = str(value) if is_number else _text(record, answer_key)
    if not isinstance(record[prompt_key], list):
        prompt = prompt_template.replace("{question}", _text(record, prompt_key))
        return Example(
            source, line, prompt=prompt, completion=None if answer is None else " " + answer
        )
    turns = _messages(record, prompt_key)
    if answer is None:
        return Example(source, line, messages=turns)
    if turns[-1]["role"] == "assistant":
        raise _BadLine(
            f"the chat in '{prompt_key}' ends with an assistant turn, so the answer "
            f"('{answer_key}') cannot be the reply to it; end the prompt with a user turn"
        )
    return Example(source, line, messages=(*turns, {"role": "assistant", "content": answer}))


def _text(record: dict[str, Any], key: str) -> str:
    if key not in record:
        raise _BadLine(f"missing field '{key}'")
    value = record[key]
    if not isinstance(value, str):
        raise _BadLine(f"field '{key}' must be a string, got {_kind(value)}")
    return value
