"""Records of local data sets other than JSONL: Parquet and Arrow files, directories written
by ``datasets.save_to_disk``, and ``.json`` files holding one JSON array of objects.

Parquet, Arrow and ``save_to_disk`` data are read through Hugging Face ``datasets`` (its
column types decode as ``datasets`` decodes them), from local files only: nothing here
looks anything up on the Hub, and ``HF_DATASETS_OFFLINE=1`` is set before ``datasets`` is
first imported. Nothing is written to the ``datasets`` cache (no ``load_dataset``).
``datasets`` is imported only when such a file is read, so JSONL runs never pay for it.

Rows are numbered from 1, as lines are, so ``data.parquet:5`` is ``dataset[4]``. A file
that cannot be read at all is one :class:`~strop.errors.DataError` naming it; what is wrong
with a single row is for :mod:`strop.data.sources` to say, by file and row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from strop.errors import DataError

TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = (".jsonl", ".json", *TABLE_SUFFIXES)
_DISK_MARKERS = ("state.json", "dataset_dict.json")


def is_table(path: Path) -> bool:
    """Whether ``path`` is read here: a Parquet or Arrow file, a directory, or a ``.json``
    file holding a JSON array (one that holds JSON lines is read as JSONL)."""
    if path.is_dir() or path.suffix.lower() in TABLE_SUFFIXES:
        return True
    return path.suffix.lower() == ".json" and _first_byte(path) == b"["


def read_rows(path: Path) -> tuple[list[str], int, Iterator[dict[str, Any]]]:
    """The column names, the number of rows and the rows (dicts) of a table at ``path``."""
    if not path.exists():
        raise DataError(f"data file {path} not found: check data.train_path / data.eval_path")
    if path.suffix.lower() == ".json":
        return _json_array(path)
    dataset = _open(path)
    return list(dataset.column_names), len(dataset), iter(dataset)


def _open(path: Path) -> Any:
    """A ``datasets.Dataset`` over the Parquet/Arrow file or ``save_to_disk`` directory."""
    if path.is_dir() and not any((path / name).is_file() for name in _DISK_MARKERS):
        raise DataError(
            f"data path {path} is a directory, but not one written by datasets' "
            "save_to_disk (it has no state.json or dataset_dict.json); point "
            f"data.train_path / data.eval_path at such a directory or at a "
            f"{', '.join(SUFFIXES)} file"
        )
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # a core dependency; only a broken install lacks it
        raise DataError(f"reading {path} needs the 'datasets' package ({e})") from None
    datasets.disable_progress_bars()  # strop draws its own progress
    if path.is_dir():
        kind, read = "a datasets.save_to_disk directory", datasets.load_from_disk
    elif path.suffix.lower() == ".parquet":
        kind, read = "a Parquet file", lambda p: datasets.Dataset(pq.read_table(p))
    else:
        kind, read = "an Arrow file", lambda p: datasets.Dataset(_arrow_table(pa, p))
    try:
        dataset = read(str(path))
    except Exception as e:  # pyarrow and datasets raise many kinds for a bad file
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"cannot read {path} as {kind}: {detail}") from None
    if isinstance(dataset, datasets.DatasetDict):
        splits = list(dataset)
        raise DataError(
            f"{path} holds a DatasetDict with splits {', '.join(splits)}; point "
            f"data.train_path / data.eval_path at one split's directory, e.g. "
            f"{path / (splits[0] if splits else 'train')}"
        )
    return dataset


def _arrow_table(pa: Any, path: str) -> Any:
    """An Arrow file's table: the streaming format ``datasets`` writes, else the IPC file
    (Feather v2) format."""
    with pa.memory_map(path) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()


def _json_array(path: Path) -> tuple[list[str], int, Iterator[dict[str, Any]]]:
    """The objects of a ``.json`` file holding one JSON array; a non-object element is a
    bad row (the reader names it), not a bad file."""
    try:
        with path.open(encoding="utf-8-sig") as handle:
            rows = json.load(handle)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 (byte {e.start}); save it as UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); a .json "
            "data file holds one array of objects, or one object per line"
        ) from None
    if not isinstance(rows, list):  # _first_byte saw "[", so only a trailing mess gets here
        raise DataError(f"{path} must hold a JSON array of objects")
    columns = list(dict.fromkeys(key for row in rows if isinstance(row, dict) for key in row))
    return columns, len(rows), iter(rows)


def _first_byte(path: Path) -> bytes:
    """The first byte of ``path`` that is not whitespace or a byte-order mark (b"" if none
    or unreadable: the JSONL reader then says what is wrong)."""
    try:
        with path.open("rb") as handle:
            head = handle.read(4096)
    except OSError:
        return b""
    return head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1]
