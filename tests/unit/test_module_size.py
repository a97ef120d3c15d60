"""Module size: a prompt to look, not a wall (docs/architecture.md, "Module size").

A module of the library over 400 lines is reported as a warning and must say why in its
module docstring, on a line starting ``Over 400 lines:`` (one job that reads best whole,
say); none may pass 600. A hard cap at 400 split modules by size rather than by job (a
policy's preference forward moved out of the policy and bound back onto it), so the line
now asks a reader to look, and a reason answers it.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import strop

ROOT = Path(strop.__file__).parent
LOOK, LIMIT = 400, 600
REASON = "Over 400 lines:"


def size_findings(sources: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(failures, notes)`` of modules' source texts by name: a failure for a module over
    :data:`LIMIT` lines, or over :data:`LOOK` without a :data:`REASON` line in its
    docstring; a note for every module over :data:`LOOK`."""
    failures, notes = [], []
    for name, text in sorted(sources.items()):
        lines = len(text.splitlines())
        if lines <= LOOK:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        reason = [line for line in docstring.splitlines() if line.strip().startswith(REASON)]
        if lines > LIMIT:
            failures.append(f"{name}: {lines} lines, over {LIMIT}")
        elif not reason:
            failures.append(f"{name}: {lines} lines and no '{REASON} ...' line in its docstring")
        notes.append(f"{name}: {lines} lines ({reason[0].strip() if reason else 'no reason'})")
    return failures, notes


def test_modules_over_400_lines_say_why_and_none_is_over_600():
    sources = {str(path.relative_to(ROOT)): path.read_text() for path in ROOT.rglob("*.py")}
    assert len(sources) > 100  # the whole package was read
    failures, notes = size_findings(sources)
    for note in notes:
        warnings.warn(f"a module over {LOOK} lines, worth a look: {note}", stacklevel=1)
    assert not failures, "\n".join(failures)


def module(lines: int, docstring: str = "A module.") -> str:
    body = "\n".join(f"x{i} = {i}" for i in range(lines - 1))
    return f'"""{docstring}"""\n{body}\n'


def test_the_rule_fails_past_600_or_past_400_without_a_reason():
    reason = "What it does.\n\nOver 400 lines: one job, read best whole."
    failures, notes = size_findings({
        "small.py": module(400),
        "long_with_reason.py": module(401, reason),
        "long_without.py": module(401),
        "too_long.py": module(601, reason),
    })  # fmt: skip
    assert [f.split(":")[0] for f in failures] == ["long_without.py", "too_long.py"]
    assert [n.split(":")[0] for n in notes] == [
        "long_with_reason.py", "long_without.py", "too_long.py",
    ]  # fmt: skip
    assert "Over 400 lines: one job" in notes[0]
