"""The house drawn from the imports (docs/architecture.md): no import circle between kvcached's modules,
and no arrow from the core (pools, layouts, devices, tensor views) up to the registry or the options.

Read from the source with ``ast``: every import counts, at module level, inside a function (a lazy
import is still an arrow) or under ``TYPE_CHECKING`` (a type is still a dependency).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Optional

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "python"
# Compiled modules: imported by name, not in the source tree.
EXTENSIONS = {"kvcached._core", "kvcached._cuda", "kvcached._hip"}
# The core is given what it needs by its callers; the registry and the options table sit above it.
CORE = ("kvcached.pool", "kvcached.layout", "kvcached.devices", "kvcached.tensor_views")
ABOVE_THE_CORE = ("kvcached.registry", "kvcached.config")

pytestmark = pytest.mark.skipif(not (PACKAGE_ROOT / "kvcached").is_dir(), reason="needs the source tree")

Graph = Mapping[str, set[str]]


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the kvcached package under ``root``, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((root / "kvcached").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, package: str, modules: Mapping[str, Path]) -> Iterator[str]:
    """The kvcached modules one import statement names (``from a import b`` names a.b if b is a module)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            yield submodule if submodule in modules or submodule in EXTENSIONS else source


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Module -> the kvcached modules it imports, anywhere in its source."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found.update(target for target in _imported(node, package, modules) if target in modules)
        found.discard(name)
        graph[name] = found
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def path_between(graph: Graph, start: str, goal: str) -> Optional[list[str]]:
    """A shortest chain of imports from ``start`` to ``goal``, or None."""
    came_from: dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph.get(module, ())):
                if target in came_from:
                    continue
                came_from[target] = module
                if target == goal:
                    chain = [goal]
                    while came_from[chain[-1]] is not None:
                        chain.append(came_from[chain[-1]])
                    return chain[::-1]
                following.append(target)
        frontier = following
    return None


def upward_arrows(graph: Graph) -> list[str]:
    """Every chain of imports from a core module to the registry or the options table."""
    return [
        " -> ".join(chain)
        for core in CORE
        for above in ABOVE_THE_CORE
        if (chain := path_between(graph, core, above)) is not None
    ]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_is_read_from_the_whole_package(graph):
    assert set(CORE) | set(ABOVE_THE_CORE) <= set(graph), "a module the rules name is missing"
    assert "kvcached.devices" in graph["kvcached.pool"] and "kvcached.config" in graph["kvcached.registry"]
    assert len(graph) > 80 and sum(map(len, graph.values())) > 200


def test_no_module_imports_itself_back_through_others(graph):
    assert circles(graph) == []


def test_the_core_never_reaches_up_to_the_registry_or_the_options(graph):
    assert upward_arrows(graph) == []


def test_the_checks_see_a_circle_and_an_upward_arrow():
    """The rules above would fail on a tree that breaks them (the checks are not blind)."""
    broken = {
        "kvcached.pool": {"kvcached.layout"},
        "kvcached.layout": {"kvcached.defaults"},
        "kvcached.defaults": {"kvcached.config"},
        "kvcached.config": {"kvcached.pool"},
        "kvcached.registry": set(),
        "kvcached.devices": set(),
        "kvcached.tensor_views": set(),
    }
    assert circles(broken) == [["kvcached.config", "kvcached.defaults", "kvcached.layout", "kvcached.pool"]]
    assert "kvcached.pool -> kvcached.layout -> kvcached.defaults -> kvcached.config" in upward_arrows(broken)
