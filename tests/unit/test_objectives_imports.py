"""``strop.objectives`` sits below ``rl/``, ``sft/``, ``backends/`` and ``rewards/``: none of
its modules imports them, jax, flax or torch (at the top or inside a function), so both
backends can import it without a loop."""

from __future__ import annotations

import ast
from pathlib import Path

import strop.objectives

FORBIDDEN = ("jax", "flax", "torch", "strop.rl", "strop.sft", "strop.backends", "strop.rewards")


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_objectives_import_nothing_above_them():
    folder = Path(strop.objectives.__file__).parent
    modules = sorted(folder.glob("*.py"))
    assert {p.stem for p in modules} >= {"losses", "micro", "ppo", "plugins", "sft"}
    for path in modules:
        for name in imported(path):
            bad = [f for f in FORBIDDEN if name == f or name.startswith(f + ".")]
            assert not bad, f"{path.name} imports {name}"


def test_docs_name_every_registered_entry():
    """docs/ppo.md's registries: every advantage estimator, KL estimator and policy loss the
    config accepts is documented (a new entry without its docs fails here)."""
    from strop.objectives.estimators import ESTIMATORS
    from strop.objectives.losses import KL_ESTIMATORS, POLICY_LOSSES

    docs = (Path(strop.objectives.__file__).parents[3] / "docs" / "ppo.md").read_text()
    for registry in (ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES):
        for name in registry:
            assert f"`{name}`" in docs or f"policy_loss: {name}`" in docs, name
