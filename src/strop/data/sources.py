"""JSONL records -> examples, with errors that name the file and the 1-based line.

Formats (one JSON object per line; blank lines are ignored):

- ``prompt_completion``: ``{"prompt": str, "completion": str}``
- ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
- ``gsm8k``: ``{"question": str, "answer": str}``; the answer ends with ``#### <number>``.
  The prompt is ``prompt_template`` with ``{question}`` replaced; the completion is
  ``" " + answer`` and ``reference`` is the text after ``#### ``.
- ``auto``: the format of the first record that has the keys of one of the above.

Each line is parsed with ``json.loads`` and nothing else; a line longer than
``max_record_bytes`` is refused unread (tokenizing one 50 MB record took 9.8 GB, only for
truncation to cut it to ``data.max_length``). With ``skip_bad_lines`` a bad line
is skipped and counted (and a warning logged); a file with no good record is still an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from strop.errors import DataError

if TYPE_CHECKING:
    from strop.config import DataConfig

logger = logging.getLogger(__name__)

Format = Literal["prompt_completion", "messages", "gsm8k"]
ROLES = ("system", "user", "assistant")
GSM8K_MARKER = "#### "
DEFAULT_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
_SKIP_HINT = "fix the line, or set data.skip_bad_lines=true to skip bad lines"
DEFAULT_MAX_RECORD_BYTES = 4 << 20


@dataclass(frozen=True)
class Example:
    """One record: ``prompt`` + ``completion`` text, or a chat in ``messages``.

    ``source`` and ``line`` (1-based) say where it came from; ``reference`` is the final
    answer of a gsm8k record (for rewards and accuracy), else None. ``columns`` is the
    record as read (every key of its JSON object), which reward functions receive.
    """

    source: str
    line: int
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    reference: str | None = None
    columns: dict[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ReadStats:
    """What reading a file found: its format, good records and skipped bad lines."""

    path: str
    format: Format
    num_records: int
    num_skipped: int


class _BadLine(Exception):
    """A malformed line; the message says what is wrong with it."""


def read_examples(
    path: str | Path,
    format: Literal["auto", "prompt_completion", "messages", "gsm8k"] = "auto",
    *,
    skip_bad_lines: bool = False,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> tuple[list[Example], ReadStats]:
    """Read every record of a JSONL file; raise DataError naming ``path:line`` for a bad one."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise DataError(
            f"data file {path} not found: check data.train_path / data.eval_path"
        ) from None
    except IsADirectoryError:
        raise DataError(f"data path {path} is a directory; point it at a .jsonl file") from None
    except OSError as e:
        raise DataError(f"cannot open data file {path}: {e.strerror}") from None

    examples: list[Example] = []
    fmt: Format | None = None if format == "auto" else format
    skipped = 0
    first_bad = ""
    with handle:
        for number, raw in enumerate(handle, start=1):
            try:
                size = len(raw)  # bytes: the file is read in binary
                if size > max_record_bytes:
                    raise _BadLine(
                        f"the record is {size:,} bytes, over "
                        f"data.max_record_bytes={max_record_bytes}; split it or raise the cap"
                    )
                record = _parse_line(raw, number)
                if record is None:
                    continue  # blank line
                if fmt is None:
                    fmt = detect_format(record)
                example = _to_example(record, fmt, str(path), number, prompt_template)
                examples.append(dataclasses.replace(example, columns=record))
            except _BadLine as e:
                where = f"{path}:{number}: {e}"
                if format != "auto" and str(e).startswith("missing field"):
                    where += (
                        f" (data.format={format}, set by the recipe or an override, reads "
                        f"{_FIELDS[format]} records; data.format=auto tells from the keys)"
                    )
                if not skip_bad_lines:
                    raise DataError(f"{where}; {_SKIP_HINT}") from None
                skipped += 1
                first_bad = first_bad or where

    if not examples:
        if skipped:
            raise DataError(
                f"no valid records in {path}: all {skipped} non-blank line(s) are bad "
                f"(first: {first_bad})"
            )
        raise DataError(
            f"data file {path} is empty (no records); it needs one JSON object per line"
        )
    if skipped:
        logger.warning("skipped %d bad line(s) in %s (first: %s)", skipped, path, first_bad)
    assert fmt is not None
    return examples, ReadStats(str(path), fmt, len(examples), skipped)


def read_data_file(path: str | Path, data: DataConfig) -> tuple[list[Example], ReadStats]:
    """:func:`read_examples` of ``path`` as the run's ``data:`` section says (format,
    skipping, prompt template, record size cap)."""
    return read_examples(
        path,
        data.format,
        skip_bad_lines=data.skip_bad_lines,
        prompt_template=data.prompt_template,
        max_record_bytes=data.max_record_bytes,
    )


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
        "'prompt'+'completion' or 'question'+'answer', or set data.format"
    )


def _parse_line(raw: bytes, number: int) -> dict[str, Any] | None:
    """The JSON object on one line, None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadLine(f"not valid UTF-8 (byte {e.start}); save the file as UTF-8") from None
    if number == 1:
        text = text.removeprefix("\ufeff")  # byte-order mark
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise _BadLine(f"expected a JSON object, got {_kind(record)}")
    return record


def _to_example(
    record: dict[str, Any], fmt: Format, source: str, line: int, prompt_template: str
) -> Example:
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
    return Example(source, line, messages=_messages(record))


def _text(record: dict[str, Any], key: str) -> str:
    if key not in record:
        raise _BadLine(f"missing field '{key}'")
    value = record[key]
    if not isinstance(value, str):
        raise _BadLine(f"field '{key}' must be a string, got {_kind(value)}")
    return value


def _messages(record: dict[str, Any]) -> tuple[dict[str, str], ...]:
    if "messages" not in record:
        raise _BadLine("missing field 'messages'")
    messages = record["messages"]
    if not isinstance(messages, list):
        raise _BadLine(f"field 'messages' must be a list, got {_kind(messages)}")
    if not messages:
        raise _BadLine("field 'messages' is empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _BadLine(f"messages[{i}] must be an object, got {_kind(message)}")
        for key in ("role", "content"):
            if key not in message:
                raise _BadLine(f"messages[{i}] is missing field '{key}'")
            if not isinstance(message[key], str):
                raise _BadLine(f"messages[{i}].{key} must be a string, got {_kind(message[key])}")
        if message["role"] not in ROLES:
            raise _BadLine(f"messages[{i}].role is {message['role']!r}; expected one of {ROLES}")
        out.append({"role": message["role"], "content": message["content"]})
    if out[0]["role"] == "assistant":
        raise _BadLine("messages[0] is an assistant turn; a chat starts with a system or user turn")
    return tuple(out)


def _kind(value: Any) -> str:
    """A JSON type name for messages: object, array, string, number, boolean, null."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(
        type(value), "number" if isinstance(value, int | float) else type(value).__name__
    )
