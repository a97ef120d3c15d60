"""Reading compiled XLA programs (HLO text) in tests: which ops run inside a loop."""

from __future__ import annotations

import re

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")


def computations(hlo: str) -> dict[str, list[str]]:
    """Each computation of an HLO module's text: name -> its instruction lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            name = header.group(2)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line.strip())
    return out


def ops_inside_loops(hlo: str, op: str) -> list[str]:
    """Instructions ``op`` (e.g. ``all-gather``; its async ``-start`` form too) in the body
    of any ``while`` loop, or in any computation a loop body calls."""
    comps = computations(hlo)
    bodies = [m.group(1) for lines in comps.values() for line in lines
              if (m := _WHILE_BODY.search(line))]  # fmt: skip
    seen: set[str] = set()
    while bodies:
        name = bodies.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for called in _CALLED.finditer(line):
                bodies += [c.strip().lstrip("%") for c in called.group(1).split(",")]
    pattern = re.compile(rf"\b{re.escape(op)}(-start)?\(")
    return [line for name in sorted(seen) for line in comps[name] if pattern.search(line)]
