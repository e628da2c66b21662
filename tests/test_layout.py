"""The package's import graph: no cycle, imports go one way (model -> msa -> pallas -> leaves), and a
function-level import of m3jax happens only where a named reason allows it.

Built from the source with ``ast`` (module-level and function-level imports alike, since a lazy
import inside a function is still a dependency), plus the implicit edge from a module to its parent
package's ``__init__`` (importing ``m3jax.msa.reference`` runs ``m3jax/msa/__init__.py`` first),
except where the parent itself imports that child through its own subtree (a package exposing its
submodules). The root
package ``m3jax`` is left out of those parent edges: its ``__init__`` re-exports the public API and
every submodule import runs it, which is Python's package model, not a cycle in our code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "m3jax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` names a submodule when one exists, else a name in pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # `import a.b.c` where c is a name: depend on the module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    for mod in files:
        parent = mod.rpartition(".")[0]
        # A package whose __init__ imports its own submodules (directly or through one another) is
        # Python's package pattern: they run while the parent initialises, so that is not an edge back.
        if parent and parent != "m3jax" and mod not in _reach_within(graph, parent):
            graph[mod].add(parent)
    return graph


def _reach_within(graph: dict[str, set[str]], pkg: str) -> set[str]:
    """Modules of ``pkg``'s subtree that ``pkg`` imports, following imports inside the subtree only."""
    seen, todo = set(), [pkg]
    while todo:
        for n in graph[todo.pop()]:
            if n.startswith(pkg + ".") and n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_import_graph_has_no_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


# The tiers, lowest first: a module imports its own tier and those below, never one above.
LEAVES = {"m3jax.config", "m3jax.mesh_axes", "m3jax.layers", "m3jax.cache", "m3jax.safetensors_io", "m3jax.atomic",
          "m3jax.envvars", "m3jax.msa", "m3jax.msa.reference",
          "m3jax.pallas"}  # maths, data types, file writes and settings every layer may use
TIERS = ("leaf", "pallas", "msa", "model")


def tier(mod: str) -> int:
    if mod in LEAVES:
        return 0
    if mod.startswith("m3jax.pallas."):
        return 1
    if mod.startswith("m3jax.msa."):
        return 2
    return 3


# Imports that run upward, each with its reason (none today); nothing else may.
UPWARD: dict[tuple[str, str], str] = {}

# Function-level m3jax imports, each with its reason; every other m3jax import is at module top.
LAZY = {
    ("m3jax.pallas.canaries", "m3jax.pallas.index_scores"): "each canary imports its kernel only when it runs, so a "
                                                            "kernel that fails to import fails its own canary only",
    ("m3jax.pallas.canaries", "m3jax.pallas.topk"): "as above",
    ("m3jax.pallas.canaries", "m3jax.pallas.sparse_attention"): "as above",
    ("m3jax.pallas.canaries", "m3jax.pallas.decode"): "as above",
    ("m3jax.pallas.canaries", "m3jax.pallas.grouped_matmul"): "as above",
    ("m3jax.pallas.canaries", "m3jax.msa.reference"): "as above (the canaries' references)",
    ("m3jax.selfcheck", "m3jax.cli"): "the CLI's helpers, for the command line only",
    ("m3jax.selfcheck", "m3jax.api"): "the model, for the fixture-parity check only",
    ("m3jax.selfcheck", "m3jax.generate"): "the built-in model's short generate, for --full only",
    ("m3jax.selfcheck", "m3jax.pallas.gpu_checks"): "imports every MSA kernel: one that fails to import must not "
                                                    "stop the canaries, which import each kernel on its own",
}


def _lazy_imports() -> set[tuple[str, str]]:
    """(module, imported module) of every m3jax import inside a function body."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    found = set()
    for mod, path in files.items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("m3jax"):
                    names = [f"{node.module}.{a.name}" for a in node.names]
                    found |= {(mod, n if n in files else node.module) for n in names}
                elif isinstance(node, ast.Import):
                    found |= {(mod, a.name) for a in node.names if a.name.split(".")[0] == "m3jax"}
    return found


def test_function_level_imports_are_named():
    lazy = _lazy_imports()
    unnamed = sorted(lazy - set(LAZY))
    assert not unnamed, f"function-level m3jax imports without a reason in LAZY (move them to the top): {unnamed}"
    assert not set(LAZY) - lazy, f"LAZY names imports that are gone: {sorted(set(LAZY) - lazy)}"


def upward_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, d) for m, deps in graph.items() for d in deps if tier(d) > tier(m)}


def test_imports_go_one_way():
    graph = import_graph()
    up = upward_edges(graph) - set(UPWARD)
    assert not up, "imports to a higher tier (" + " < ".join(TIERS) + f"): {sorted(up)}"
    assert not set(UPWARD) - upward_edges(graph), "UPWARD names an edge that is gone"
    for mod, deps in graph.items():
        if mod == "m3jax.msa.reference":
            assert not {d for d in deps if d != "m3jax.msa"}, f"the MSA maths import {deps}"


# Private modules used outside their package, each with its reason.
SHARED_PRIVATE_MODULES = {
    "m3jax.pallas._backend": "the one layer between m3jax and Mosaic GPU: the model asks it whether kernels run "
                             "(on_gpu) and for which target",
}


def private_uses() -> list[str]:
    """Where a module reaches another module's private names: ``from m import _x`` or ``m._x`` on an
    imported m3jax module, and a private module ``pkg._m`` used from outside ``pkg``'s subtree."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    found = []
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        aliases: dict[str, str] = {}  # local name -> the m3jax module it is bound to
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in files:
                        aliases[a.asname or a.name] = full
                    elif base in files and a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{mod}: from {base} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in files and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                target = aliases[node.value.id]
                if f"{target}.{node.attr}" not in files:
                    found.append(f"{mod}: {node.value.id}.{node.attr} ({target})")
        for target in aliases.values():
            owner, _, leaf = target.rpartition(".")
            inside = mod == owner or mod.startswith(owner + ".")
            if leaf.startswith("_") and not leaf.startswith("__") and not inside and target not in SHARED_PRIVATE_MODULES:
                found.append(f"{mod}: private module {target}")
    return sorted(set(found))


def test_no_module_reaches_another_modules_private_names():
    # A leading underscore says "this module's own": shared helpers are public in the module that owns
    # them (private modules such as pallas._backend are shared within their package only).
    assert private_uses() == []
