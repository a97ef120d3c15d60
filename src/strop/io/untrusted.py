"""Reading small files strop did not write (configs, indexes, adapter configs) without
trusting them: a size cap before parsing, one error type per caller, names shown safely."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from strop.errors import ModelError, StropError

# The largest JSON file (config.json, an index, adapter_config.json) strop parses; real
# ones are a few KB (an index of a 400B-parameter model: ~100 KB).
MAX_JSON_BYTES = 16 * 1024**2


def read_json(path: Path, error: type[StropError] = ModelError) -> Any:
    """The JSON value in ``path``; a missing, huge, unreadable or malformed file is ``error``."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise error(
                f"{path}: {size} bytes is too large for a JSON config (limit {MAX_JSON_BYTES})"
            )
        return json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None
    except OSError as err:
        raise error(f"{path}: cannot read ({err.strerror or err})") from None


@contextlib.contextmanager
def reading(path: Path, error: type[StropError], *, missing: str) -> Iterator[None]:
    """Open or read ``path`` (a file the user named) inside: a missing file is
    ``error(missing)`` (what to check), any other ``OSError`` one ``error`` line naming the
    file and the reason."""
    try:
        yield
    except FileNotFoundError:
        raise error(missing) from None
    except OSError as err:
        raise error(f"cannot read {path}: {err.strerror or err}") from None


def shown_name(name: str, limit: int = 80) -> str:
    """``name`` for a one-line error message: quoted, escaped, and cut to ``limit``."""
    text = repr(name)
    return text if len(text) <= limit else text[: limit - 5] + "...'" + f" ({len(name)} chars)"
