"""The package's import graph: no cycles, and the layering ARCHITECTURE.md promises.

Every ``import`` and ``from ... import`` of ``src/sfi`` counts, at module level or inside a
function. The same check from the command line: ``python tests/test_architecture.py``.
"""

from __future__ import annotations

import ast
import graphlib
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports (a package import counts as its ``__init__``)."""
    found: set[str] = set()
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target in modules and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted((SRC / "sfi").rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize("module, forbidden", [
    # the attention function imports neither cache: layers bring their own attend()
    ("sfi.attention", {"sfi.cache", "sfi.eviction.cache", "sfi.layers", "sfi.eviction.layer"}),
    # the Selector and the scorers know nothing of caches, layers or decoding
    ("sfi.selector", {"sfi.cache", "sfi.layers", "sfi.planner", "sfi.decode", "sfi.hf"}),
    ("sfi.scorers.registry", {"sfi.cache", "sfi.layers", "sfi.planner", "sfi.decode"}),
    # the planner decides from state and tokens only
    ("sfi.planner", {"sfi.cache", "sfi.layers", "sfi.hf", "sfi.attention", "sfi.decode"}),
    # layers hold tensors and never see their cache
    ("sfi.layers", {"sfi.cache", "sfi.methods", "sfi.decode"}),
    ("sfi.eviction.layer", {"sfi.eviction.cache", "sfi.eviction.policies", "sfi.cache"}),
])
def test_layering(module, forbidden):
    assert not reachable(import_graph(), module) & forbidden


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None


if __name__ == "__main__":
    cycle = find_cycle(import_graph())
    print("import cycle: " + " -> ".join(cycle) if cycle else "no import cycle among "
          f"{len(import_graph())} modules of sfi")
    sys.exit(1 if cycle else 0)
