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


def part(module: str) -> str:
    """The folder a module sits in (``core``, ``hf``, ...), or the module itself at the top."""
    return module.split(".")[1] if module.count(".") else module


# which parts each part of the package may import: the core imports no engine, the engines
# import the core, the loops the transformers adapter; the top-level modules (errors, notices,
# the cache folder, texts) serve every part
TOP = {"sfi.errors", "sfi.notices", "sfi.cache_folder", "sfi.texts", "sfi.runtime"}
ALLOWED_PARTS = {
    "core": {"core"},
    # the step's orchestration both engines share: over the core, no engine
    "step": {"core", "step"},
    "vllm": {"core", "step", "vllm"},
    "hf": {"core", "step", "hf", "weights"},
    "decoding": {"core", "hf", "decoding"},
    # the formats and their products; weights.choice runs the fidelity check (sfi.eval)
    "weights": {"core", "weights", "eval", "hf", "decoding"},
}


@pytest.mark.parametrize("name", sorted(ALLOWED_PARTS))
def test_each_part_imports_only_the_parts_below_it(name):
    graph = import_graph()
    found = {target for module, targets in graph.items() if part(module) == name
             for target in targets
             if target not in TOP and part(target) not in ALLOWED_PARTS[name]}
    assert not found


def test_the_weight_formats_import_no_engine():
    """The formats and their products know nothing of a cache or a loop; only ``choice``, which
    measures a format's fidelity, reaches the evaluation code."""
    graph = import_graph()
    for module in graph:
        if part(module) == "weights" and module != "sfi.weights.choice":
            assert not {t for t in reachable(graph, module) if part(t) in
                        {"hf", "decoding", "eval", "vllm"}}, module


@pytest.mark.parametrize("name", ["core", "step"])
def test_the_core_is_plain_policy_and_tensor_functions(name):
    """No transformers, no vLLM, no ``nn.Module`` in the core or the step's shared
    orchestration (``torch.nn.functional`` is allowed): both engines call them."""
    for path in (SRC / "sfi" / name).rglob("*.py"):
        text = path.read_text(encoding="utf-8").replace("torch.nn.functional", "")
        assert not third_party_imports(path) & {"transformers", "vllm"}, path.name
        assert "torch.nn" not in text and "nn.Module" not in text, path.name


LOOP = {"sfi.decoding.decode", "sfi.decoding.prefill", "sfi.decoding.decode_step",
        "sfi.decoding.stopping"}
# what the KV storage must not know of: it is told what to store and read
STORAGE_MUST_NOT_SEE = {"sfi.hf.planner", "sfi.hf.layer_attention", "sfi.hf.attention",
                        "sfi.hf.context", "sfi.core.overlap", "sfi.core.sequence_policy",
                        "sfi.core.refresh_selection", "sfi.core.selector", "sfi.core.coverage",
                        "sfi.core.triggers", "sfi.hf.slowfast_cache", "sfi.hf.methods",
                        "sfi.step.probes", *LOOP}


@pytest.mark.parametrize("module, forbidden", [
    # the attention function imports neither cache: layers bring their own attend()
    ("sfi.hf.attention", {"sfi.hf.slowfast_cache", "sfi.hf.eviction.masked_cache",
                          "sfi.hf.layer_attention", "sfi.hf.eviction.layer"}),
    # the planner decides from state and tokens only
    ("sfi.hf.planner", {"sfi.hf.slowfast_cache", "sfi.hf.layer_attention", "sfi.hf.routing",
                        "sfi.hf.attention"}),
    # a layer's attention never sees its cache
    ("sfi.hf.layer_attention", {"sfi.hf.slowfast_cache", "sfi.hf.methods"}),
    # storage only stores: nothing of the plan, the step, the policy or the refresh
    ("sfi.hf.slab", STORAGE_MUST_NOT_SEE),
    ("sfi.hf.eviction.layer", {"sfi.hf.eviction.masked_cache", "sfi.hf.eviction.policies",
                               "sfi.hf.slowfast_cache"}),
    # the Selector and the scorers are below the sequence policy and the refresh
    ("sfi.core.selector", {"sfi.core.sequence_policy", "sfi.core.refresh_selection"}),
    ("sfi.core.sequence_policy", {"sfi.core.kernels", "sfi.core.refresh_selection"}),
    ("sfi.core.refresh_selection", {"sfi.core.sequence_policy"}),
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


def test_every_module_sits_in_a_part():
    """The top of the package holds the public entry points and the process-wide helpers; the
    rest is in folders that say which part it is."""
    top = {m for m in import_graph() if m.count(".") == 1 and
           not (SRC / Path(*m.split("."))).is_dir()}
    assert top <= TOP | {"sfi.__main__", "sfi.models"}


def test_the_vllm_glue_keeps_no_module_state_on_the_step_path():
    """No ``global`` statement in ``sfi/vllm``: the impl reads its step from its arguments."""
    for path in (SRC / "sfi" / "vllm").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], path.name


MUTATING_METHODS = {"append", "add", "update", "clear", "pop", "popitem", "setdefault", "extend",
                    "insert", "remove", "discard", "set", "reset"}  # set, reset: a ContextVar


def module_state(path: Path) -> set[str]:
    """The names bound at module level in ``path`` that its code mutates: an item or attribute
    assigned or deleted, a mutating method called (``append``, ``add``, ``update``, ...), or
    ``next()`` drawn from it; ``globals()`` written to counts as the name ``globals()``."""
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
                isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node.value, ast.Name):
                mutated.add(node.value.id)
            elif isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                    and node.value.func.id == "globals":
                names.add("globals()")
                mutated.add("globals()")
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
    # the public names, each imported from its module on first use and kept (PEP 562)
    "sfi": {"globals()"},
    # the step in progress: transformers calls the attention function with no argument sfi
    # controls, so the routing hook sets it around each forward (the one hand-off of a step)
    "sfi.hf.context": {"_CURRENT"},
    # the classes made by wrapping vLLM's backends: vLLM imports a backend by its dotted path
    "sfi.vllm.backend": {"globals()"},
}


def test_no_module_keeps_mutable_state_but_the_known():
    """State reaches a function as arguments: no module-level dict, list, set or object that
    the code mutates, except :data:`KNOWN_MODULE_STATE`."""
    found = {module_name(p): names for p in (SRC / "sfi").rglob("*.py")
             if (names := module_state(p))}
    assert found == KNOWN_MODULE_STATE


def test_the_module_state_check_finds_state(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import itertools, contextvars\nA = {}\nB = []\nC = itertools.count()\n"
                    "D = {}\nE = contextvars.ContextVar('e')\n"
                    "def f():\n    A['x'] = 1\n    B.append(2)\n    E.set(3)\n"
                    "    globals()['g'] = 4\n    return next(C), D.get(1)\n")
    assert module_state(path) == {"A", "B", "C", "E", "globals()"}


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None


if __name__ == "__main__":
    cycle = find_cycle(import_graph())
    print("import cycle: " + " -> ".join(cycle) if cycle else "no import cycle among "
          f"{len(import_graph())} modules of sfi")
    sys.exit(1 if cycle else 0)
