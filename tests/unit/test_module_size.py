"""Small modules: no module of the library is over 400 lines (docs/architecture.md).

A module that grows past it is split where its parts do different jobs (as the commands'
closing tables left ``cli.py`` for ``summaries.py``), not squeezed under the line.
"""

from __future__ import annotations

from pathlib import Path

import strop

ROOT = Path(strop.__file__).parent
LIMIT = 400


def test_no_module_is_over_400_lines():
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines())
             for path in ROOT.rglob("*.py")}  # fmt: skip
    assert len(sizes) > 100  # the whole package was read
    over = {str(path): n for path, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines: {over}"
