"""A data file's records, one at a time, each bad one refused by ``file:line`` or skipped.

:func:`read_records` is the loop every reader of records shares (SFT and prompt examples in
:mod:`strop.data.sources`, preference pairs in :mod:`strop.data.preferences`): a JSONL
file's lines (each parsed with ``json.loads`` and nothing else; blank lines ignored; a line
over ``max_record_bytes`` refused unread) or a table's rows (:mod:`strop.data.tables`),
each handed to the reader's ``convert``, which raises :class:`_BadLine` to say what is wrong
with one. A bad record stops the read with a :class:`~strop.errors.DataError` naming
``path:line`` (``path:row``), or with ``skip_bad_lines`` is skipped, counted and named in
one warning; what a file with no good record means is the reader's to say.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from strop.data import tables
from strop.data.chat_records import _BadLine, _kind
from strop.errors import DataError
from strop.io.untrusted import reading

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordsRead:
    """What :func:`read_records` found: the converted records, how many bad ones were
    skipped (the first named), and whether the file was read as a table (rows) or JSONL
    (lines)."""

    items: list[Any]
    skipped: int
    first_bad: str
    table: bool

    @property
    def unit(self) -> str:
        return "row" if self.table else "line"


def read_records(
    path: Path,
    convert: Callable[[dict[str, Any], int, bool], Any],
    *,
    columns: Mapping[str, str | None],
    skip_bad_lines: bool,
    max_record_bytes: int,
    explain: Callable[[_BadLine], str] = lambda _: "",
) -> RecordsRead:
    """``convert(record, number, table)`` of every record of ``path`` (see the module
    docstring). ``columns``: the keys a table must have, each with the setting that names it
    (None: none), refused before any row is read; ``explain(bad)``: more to say after a bad
    record's reason."""
    table = tables.is_table(path)
    if table:
        names, _, rows = tables.read_rows(path)
        for key, setting in columns.items():
            if names and key not in names:
                by = f" ({setting})" if setting else ""
                raise DataError(
                    f"{path}: no column '{key}'{by}; its columns are {', '.join(names)}"
                )
        numbered: Iterator[tuple[int, Any]] = enumerate(rows, start=1)
    else:
        numbered = _jsonl_records(_open_jsonl(path), max_record_bytes)
    unit = "row" if table else "line"
    items: list[Any] = []
    skipped, first_bad = 0, ""
    for number, record in numbered:
        try:
            if isinstance(record, _BadLine):
                raise record
            if record is None and not table:
                continue  # blank line
            if not isinstance(record, dict):  # an element of a .json array
                raise _BadLine(f"expected a JSON object, got {_kind(record)}")
            items.append(convert(record, number, table))
        except _BadLine as e:
            where = f"{path}:{number}: {e}{explain(e)}"
            if not skip_bad_lines:
                raise DataError(
                    f"{where}; fix the {unit}, or set data.skip_bad_lines=true to skip bad {unit}s"
                ) from None
            skipped += 1
            first_bad = first_bad or where
    if items and skipped:
        logger.warning("skipped %d bad %s(s) in %s (first: %s)", skipped, unit, path, first_bad)
    return RecordsRead(items, skipped, first_bad, table)


def check_text_size(texts: list[str], max_record_bytes: int) -> None:
    """A table row's text over the cap is a bad row, as an over-long JSONL line is."""
    size = sum(len(text.encode("utf-8")) for text in texts)
    if size > max_record_bytes:
        raise _BadLine(
            f"the record's text is {size:,} bytes, over data.max_record_bytes="
            f"{max_record_bytes}; split it or raise the cap"
        )


def _open_jsonl(path: Path) -> BinaryIO:
    missing = f"data file {path} not found: check data.train_path / data.eval_path"
    with reading(path, DataError, missing=missing):
        return path.open("rb")


def _jsonl_records(handle: BinaryIO, max_record_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` for every line: its object, None for a blank line, or the
    :class:`_BadLine` that says what is wrong with it."""
    with handle:
        for number, raw in enumerate(handle, start=1):
            size = len(raw)  # bytes: the file is read in binary
            if size > max_record_bytes:
                yield (
                    number,
                    _BadLine(
                        f"the record is {size:,} bytes, over "
                        f"data.max_record_bytes={max_record_bytes}; split it or raise the cap"
                    ),
                )
                continue
            try:
                yield number, _parse_line(raw, number)
            except _BadLine as e:
                yield number, e


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
