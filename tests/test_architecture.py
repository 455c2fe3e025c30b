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


# what either engine's own mechanics are made of
LOOP = {"sfi.decode", "sfi.prefill", "sfi.decode_step", "sfi.stopping"}  # the transformers loop
ENGINES = {"sfi.slowfast_cache", "sfi.layer_attention", "sfi.slab", "sfi.hf", "sfi.attention",
           *LOOP, "sfi.vllm.backend", "sfi.vllm.impl", "sfi.vllm.metadata", "sfi.vllm.builder",
           "sfi.vllm.requests"}
TRANSFORMERS_PATH = {"sfi.planner", "sfi.layer_attention", "sfi.slab", "sfi.slowfast_cache",
                     "sfi.hf", *LOOP, "sfi.methods", "sfi.bench", "sfi.bench.throughput",
                     "sfi.bench.vllm", "sfi.eval", "sfi.eval.runner", "sfi.eval.fidelity"}

# what the KV storage must not know of: it is told what to store and read
STORAGE_MUST_NOT_SEE = {"sfi.planner", "sfi.layer_attention", "sfi.attention", "sfi.context",
                        "sfi.overlap", "sfi.sequence_policy", "sfi.refresh_selection",
                        "sfi.selector", "sfi.coverage", "sfi.triggers", "sfi.slowfast_cache",
                        "sfi.methods", *LOOP}


@pytest.mark.parametrize("module, forbidden", [
    # the attention function imports neither cache: layers bring their own attend()
    ("sfi.attention", {"sfi.slowfast_cache", "sfi.eviction.masked_cache", "sfi.layer_attention",
                       "sfi.eviction.layer"}),
    # the Selector and the scorers know nothing of caches, layers or decoding
    ("sfi.selector", {"sfi.slowfast_cache", "sfi.layer_attention", "sfi.planner", "sfi.hf",
                      *LOOP}),
    ("sfi.scorers.registry", {"sfi.slowfast_cache", "sfi.layer_attention", "sfi.planner", *LOOP}),
    # the planner decides from state and tokens only
    ("sfi.planner", {"sfi.slowfast_cache", "sfi.layer_attention", "sfi.hf", "sfi.attention",
                     *LOOP}),
    # the sequence policy and the selection are engine-neutral: both engines call them
    ("sfi.sequence_policy", ENGINES | {"sfi.planner", "sfi.kernels", "sfi.refresh_selection"}),
    ("sfi.refresh_selection", ENGINES | {"sfi.planner", "sfi.sequence_policy"}),
    ("sfi.memory_tensors", ENGINES | {"sfi.planner", "sfi.kernels", "sfi.refresh_selection"}),
    # a layer's attention never sees its cache
    ("sfi.layer_attention", {"sfi.slowfast_cache", "sfi.methods", *LOOP}),
    # storage only stores: nothing of the plan, the step, the policy or the refresh
    ("sfi.slab", STORAGE_MUST_NOT_SEE),
    # the vLLM plugin shares the core, not the transformers path's batch plan or tensors
    *[(module, TRANSFORMERS_PATH) for module in
      ("sfi.vllm.requests", "sfi.vllm.paged", "sfi.vllm.metadata", "sfi.vllm.builder",
       "sfi.vllm.impl", "sfi.vllm.backend", "sfi.vllm.settings", "sfi.vllm")],
    ("sfi.eviction.layer", {"sfi.eviction.masked_cache", "sfi.eviction.policies",
                            "sfi.slowfast_cache"}),
])
def test_layering(module, forbidden):
    assert not reachable(import_graph(), module) & forbidden


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the packages outside sfi that ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"sfi", "__future__"}


@pytest.mark.parametrize("module", ["sequence_policy", "refresh_selection", "kernels",
                                    "memory_tensors"])
def test_the_core_imports_no_engine(module):
    """No transformers, no vLLM, no torch.nn modules: plain policy and tensor functions (the
    kernels both engines call included)."""
    path = SRC / "sfi" / f"{module}.py"
    assert not third_party_imports(path) & {"transformers", "vllm"}
    assert "torch.nn" not in path.read_text(encoding="utf-8")


def test_the_vllm_glue_keeps_no_module_state_on_the_step_path():
    """No ``global`` statement in ``sfi/vllm``: the impl reads its step from its arguments."""
    for path in (SRC / "sfi" / "vllm").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], path.name


MUTATING_METHODS = {"append", "add", "update", "clear", "pop", "popitem", "setdefault", "extend",
                    "insert", "remove", "discard"}


def module_state(path: Path) -> set[str]:
    """The names bound at module level in ``path`` that its code mutates: an item or attribute
    assigned or deleted, a mutating method called (``append``, ``add``, ``update``, ...), or
    ``next()`` drawn from it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and node.value is not None \
                and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    mutated = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Subscript, ast.Attribute)) and \
                isinstance(node.ctx, (ast.Store, ast.Del)) and isinstance(node.value, ast.Name):
            mutated.add(node.value.id)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATING_METHODS and \
                    isinstance(func.value, ast.Name):
                mutated.add(func.value.id)
            elif isinstance(func, ast.Name) and func.id == "next" and node.args and \
                    isinstance(node.args[0], ast.Name):
                mutated.add(node.args[0].id)
    return names & mutated


# module state that remains, each with its reason; the test fails on any other, and on one of
# these that is gone (so that the list shrinks with the code)
KNOWN_MODULE_STATE = {
    # what the library said once per process (a notice is, by definition, process-wide)
    "sfi.notices": {"_said"},
    # the vLLM plugin's one owner of its state (the configuration in force and the request
    # book made under it): vLLM constructs the builders and impls with no argument sfi
    # controls, so they find it there, and pass what is below it along as arguments
    "sfi.vllm.settings": {"_STATE"},
}


def test_no_module_keeps_mutable_state_but_the_known():
    """State reaches a function as arguments: no module-level dict, list, set or object that
    the code mutates, except :data:`KNOWN_MODULE_STATE`."""
    found = {module_name(p): names for p in (SRC / "sfi").rglob("*.py")
             if (names := module_state(p))}
    assert found == KNOWN_MODULE_STATE


def test_the_module_state_check_finds_state(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import itertools\nA = {}\nB = []\nC = itertools.count()\nD = {}\n"
                    "def f():\n    A['x'] = 1\n    B.append(2)\n    return next(C), D.get(1)\n")
    assert module_state(path) == {"A", "B", "C"}


MAX_LINES = 450


def test_no_module_is_longer_than_it_can_be_read():
    """Every module of ``src/sfi`` is at most 450 lines (split by responsibility beyond)."""
    long = {module_name(p): n for p in (SRC / "sfi").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None


if __name__ == "__main__":
    cycle = find_cycle(import_graph())
    print("import cycle: " + " -> ".join(cycle) if cycle else "no import cycle among "
          f"{len(import_graph())} modules of sfi")
    sys.exit(1 if cycle else 0)
