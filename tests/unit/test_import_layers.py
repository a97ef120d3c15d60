"""The package layers, read from the source with ``ast`` (nothing is imported).

Every ``import strop...`` / ``from strop... import ...`` counts, at module level and inside
functions alike (a lazy import is still a dependency); only ``if TYPE_CHECKING:`` imports
(annotations, never run) do not. No two modules of ``src/strop`` import each other, directly
or round a loop. Folder-level edges among the
training packages (``backends``, ``rl``, ``sft``, ``dpo``, ``rewards``) may not form a loop: the
backends sit above the core they are driven by, and what both need (batch layout,
objectives, the reward model's checks) lives in packages below both. The core packages
import no array framework at module level.
"""

from __future__ import annotations

import ast
import graphlib
import itertools
from collections import defaultdict
from pathlib import Path

import strop

ROOT = Path(strop.__file__).parent
LAYERED = ("backends", "rl", "sft", "dpo", "rewards")
# the core: never jax/torch/flax/transformers at module level (the backends alone may)
CORE = (
    "rl",
    "sft",
    "dpo",
    "rewards",
    "data",
    "io",
    "config",
    "batch",
    "objectives",
    "engines",
    "agents",
)
FRAMEWORKS = ("jax", "jaxlib", "flax", "optax", "orbax", "qwix", "torch", "transformers", "peft")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """``(imported module, at module level, line)`` for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    top = {id(node) for node in tree.body}
    typing_only = {  # `if TYPE_CHECKING:` imports: annotations, never run
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        at_top = id(node) in top
        if isinstance(node, ast.Import):
            found += [(alias.name, at_top, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((base, at_top, node.lineno))
            # `from strop import rewards` names a package too
            found += [(f"{base}.{alias.name}", at_top, node.lineno) for alias in node.names]
    return found


def part(module: str, among: tuple[str, ...] | None = None) -> str | None:
    """The top-level part of strop (a folder or a module) that ``strop.X...`` lives in, if
    it is one of ``among`` (None: any part), else None."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "strop":
        return None
    name = parts[1]
    if not ((ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()):
        return None  # a name `from strop import X` takes from strop/__init__.py
    return name if among is None or name in among else None


def part_edges(among: tuple[str, ...] | None = None) -> dict[tuple[str, str], dict[str, str]]:
    """``(from part, to part)`` -> the import lines that make that edge."""
    edges: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for path in sorted(ROOT.rglob("*.py")):
        source = part(module_name(path), among)
        if source is None:
            continue
        for target, _, line in imports(path):
            into = part(target, among)
            if into is not None and into != source:
                edges[source, into].setdefault(f"{path.relative_to(ROOT)}:{line}", target)
    return edges


def cycles(edges: dict[tuple[str, str], dict[str, str]]) -> list[list[str]]:
    """Every elementary loop among the folders (few nodes: a plain search)."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    loops = []

    def visit(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                loops.append([*path, start])
            elif nxt not in path and nxt > start:
                visit(start, nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, start, [start])
    return loops


def described(edges: dict[tuple[str, str], dict[str, str]]) -> str:
    """Each loop, with the import lines that make each of its edges."""
    lines = []
    for loop in cycles(edges):
        lines.append(" -> ".join(loop))
        for a, b in itertools.pairwise(loop):
            lines += [f"    {where} imports {target}" for where, target in edges[a, b].items()]
    return "\n".join(lines)


def test_no_folder_level_loop_among_backends_rl_sft_rewards():
    edges = part_edges(LAYERED)
    assert not cycles(edges), "folder-level import loops:\n" + described(edges)


def test_no_loop_among_the_top_level_parts():
    """The same over every folder and module directly under strop/ (job.py, preflight.py,
    scoring.py, ... too): the house has floors, and every import points down."""
    edges = part_edges()
    assert not cycles(edges), "import loops between strop's parts:\n" + described(edges)


def test_the_core_imports_no_framework_at_module_level():
    found = []
    for name in CORE:
        for path in sorted((ROOT / name).rglob("*.py")) if (ROOT / name).is_dir() else []:
            for target, at_top, line in imports(path):
                if at_top and target.split(".")[0] in FRAMEWORKS:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not found, "\n".join(found)


def test_the_walk_sees_lazy_imports(tmp_path):
    """The reader finds an import inside a function and a relative one (a check of the
    checker: a loop made by a lazy import must not slip through)."""
    package = tmp_path / "strop" / "rl"
    package.mkdir(parents=True)
    code = "def f():\n    from strop.backends import get_backend\n    from ..sft import loop\n"
    (package / "x.py").write_text(code)
    global ROOT
    saved, ROOT = ROOT, tmp_path / "strop"
    try:
        found = imports(package / "x.py")
    finally:
        ROOT = saved
    assert ("strop.backends", False, 2) in found
    assert ("strop.sft.loop", False, 3) in found
    assert cycles({("rl", "backends"): {}, ("backends", "rl"): {}}) == [
        ["backends", "rl", "backends"]
    ]


def module_edges() -> dict[str, dict[str, str]]:
    """Module -> {imported module of strop: the first import line that makes the edge}.

    ``from package import name`` is an edge to ``package.name`` when that is a module (the
    submodule it imports), else to ``package``; a module does not count its parent packages
    (Python runs their ``__init__`` first, but they are the package's entrance, not a
    dependency the module chose), as import-linter and grimp count it."""
    paths = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for source, path in paths.items():
        found = imports(path)
        for target, _, line in found:
            named = {t for t, _, at in found if at == line and t.startswith(f"{target}.")}
            if target not in paths or target == source or named & paths.keys():
                continue  # not a module of strop, itself, or a package whose submodule is named
            edges[source].setdefault(target, f"{path.relative_to(ROOT)}:{line}")
    return edges


def module_cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Loops among the modules: one per edge cut (graphlib finds one, it is cut, the search
    runs again), so every loop is broken by some reported one."""
    graph = {source: set(targets) for source, targets in edges.items()}
    loops = []
    while True:
        try:
            graphlib.TopologicalSorter(graph).prepare()
        except graphlib.CycleError as exc:
            loop = exc.args[1]  # [a, b, ..., a]: each node is a dependency of the one before
            loops.append(loop[::-1])
            graph[loop[-1]].discard(loop[-2])
        else:
            return loops


def test_no_import_cycle_between_modules():
    """No module of strop imports one that imports it back, directly or round a loop (lazy
    imports count: a loop through a function's import is still a loop)."""
    edges = module_edges()
    loops = module_cycles(edges)
    lines = []
    for loop in loops:
        lines.append(" -> ".join(loop))
        lines += [f"    {edges[a][b]} imports {b}" for a, b in itertools.pairwise(loop)]
    assert not loops, "import cycles between strop's modules:\n" + "\n".join(lines)


def test_the_module_walk_finds_a_loop_through_a_lazy_import(tmp_path):
    """A check of the checker: a loop made by an import inside a function is found, and
    ``from package import submodule`` is an edge to the submodule."""
    package = tmp_path / "strop" / "agents"
    package.mkdir(parents=True)
    (tmp_path / "strop" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "env.py").write_text("def f():\n    from strop.agents import source\n")
    (package / "source.py").write_text("from strop.agents.env import f\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path / "strop"
    try:
        edges = module_edges()
    finally:
        ROOT = saved
    assert edges == {
        "strop.agents.env": {"strop.agents.source": "agents/env.py:2"},
        "strop.agents.source": {"strop.agents.env": "agents/source.py:1"},
    }
    assert module_cycles(edges) in (
        [["strop.agents.env", "strop.agents.source", "strop.agents.env"]],
        [["strop.agents.source", "strop.agents.env", "strop.agents.source"]],
    )
