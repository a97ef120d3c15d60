"""``python tests/integration/poisoned_strop.py ARGS`` runs ``strop ARGS`` with one row of a
model's weights made non-finite as it is read: the fault ``test_nonfinite.py`` needs.

strop refuses a checkpoint that holds NaN/Inf (``SafetensorsReader.get``), so the model
directory stays finite on disk and carries a ``poison.json``
(``{"tensor": ..., "row": ..., "value": "inf"}``); the reader's result is poisoned after
that check, as weights that went non-finite in memory would be. :func:`install` does the
same in-process (with pytest's ``monkeypatch.setattr``, so it is undone after the test).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from strop.io.hf import SafetensorsReader

POISON_FILE = "poison.json"


def write_poison(model_dir: Path, tensor: str, row: int, value: float) -> None:
    """Mark ``model_dir``: row ``row`` of ``tensor`` reads as ``value``."""
    spec = {"tensor": tensor, "row": row, "value": repr(float(value))}
    (model_dir / POISON_FILE).write_text(json.dumps(spec))


def install(setattr: Callable = setattr) -> None:
    """Poison what ``SafetensorsReader.get`` returns for marked model directories."""
    read = SafetensorsReader.get

    def get(self: SafetensorsReader, name: str):
        array = read(self, name)
        marker = Path(self._file_of[name]).parent / POISON_FILE
        if not marker.is_file():
            return array
        spec = json.loads(marker.read_text())
        if spec["tensor"] != name:
            return array
        array = array.copy()
        array[spec["row"]] = float(spec["value"])
        return array

    setattr(SafetensorsReader, "get", get)


if __name__ == "__main__":
    install()
    from strop.cli import main

    sys.argv[0] = "strop"
    main()
