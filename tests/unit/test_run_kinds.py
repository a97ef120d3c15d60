"""The run-kind registry is the one home of what differs between kinds of run (issue 46):
read from the source with ``ast``, nothing in ``src/strop`` branches on a kind's name
outside :mod:`strop.run.kinds`, and the role plan is derived in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import strop
from strop.config import load_config
from strop.errors import ConfigError
from strop.run.kinds import KINDS, RunKind, planned_kinds, register, run_kind

ROOT = Path(strop.__file__).parent
REGISTRY = ROOT / "run" / "kinds.py"


def _names(node: ast.AST) -> list[str]:
    """The kind names a comparison operand spells: a string, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and node.value in KINDS:
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [name for element in node.elts for name in _names(element)]
    return []


def kind_branches(tree: ast.AST) -> list[int]:
    """Lines that branch on a kind's name: ``x == "ppo"``, ``x in ("sft", "dpo")``, and a
    dict keyed by two kinds' names or more looked up on the spot
    (``{"ppo": ..., "dpo": ...}.get(job)``, ``{...}[job]``; a registry of things named like
    kinds, such as the CLI's demos, is not a branch)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            if any(_names(operand) for operand in (node.left, *node.comparators)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript | ast.Attribute):
            table = node.value
            if isinstance(table, ast.Dict) and sum(bool(_names(k)) for k in table.keys if k) >= 2:
                lines.append(table.lineno)
    return lines


def role_plan_derivations(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "from_config"
        and isinstance(node.value, ast.Name)
        and node.value.id == "RolePlan"
    ]


def _scan(find) -> dict[str, list[int]]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        lines = find(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(ROOT))] = lines
    return found


def test_the_checkers_see_what_they_count() -> None:
    source = """
if job == "ppo": pass
if kind in ("sft", "dpo"): pass
steps = {"ppo": 1, "dpo": 2}.get(job)
DEMOS = {"dpo": 1, "distill": 2}
if name == "other": pass
plan = RolePlan.from_config(config)
"""
    assert kind_branches(ast.parse(source)) == [2, 3, 4]
    assert role_plan_derivations(ast.parse(source)) == [7]


def test_no_module_branches_on_a_kind_of_runs_name() -> None:
    branches = _scan(kind_branches)
    outside = {path: lines for path, lines in branches.items() if path != "run/kinds.py"}
    assert outside == {}, f"branches on a kind's name: read its RunKind instead: {outside}"
    assert sum(map(len, branches.values())) <= 2


def test_the_role_plan_is_derived_in_one_place() -> None:
    derived = _scan(role_plan_derivations)
    assert list(derived) == ["run/kinds.py"] and len(derived["run/kinds.py"]) == 1, derived


def test_every_kind_that_trains_declares_its_steps_and_model() -> None:
    config = load_config("tiny")
    for kind in KINDS.values():
        assert (kind.steps_key is not None) == kind.trains, kind.name
        if kind.trains:
            assert kind.total_steps(config) > 0 and kind.build is not None, kind.name
    assert planned_kinds()[0].name == "sft"  # strop plan's default


def test_an_unknown_kind_is_one_line_and_a_second_declaration_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^no kind of run named 'grpo': strop knows sft, "):
        run_kind("grpo")
    with pytest.raises(ValueError, match="registered already"):
        register(RunKind("sft", trains=True, samples=False, steps_key="sft.steps",
                         steps=lambda config: 1, rows_per_pass=lambda config: {}))  # fmt: skip
