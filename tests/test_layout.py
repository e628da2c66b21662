"""The package's import graph: no cycle, and imports go one way (model -> msa -> pallas -> msa.reference).

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


def test_imports_go_one_way():
    graph = import_graph()
    upper = {"m3jax.model", "m3jax.api", "m3jax.engine", "m3jax.probe", "m3jax.train", "m3jax.generate"}
    for mod, deps in graph.items():
        if mod.startswith("m3jax.pallas"):  # kernels see only kernels and the MSA maths
            bad = {d for d in deps if not d.startswith("m3jax.pallas") and d != "m3jax.msa.reference"}
            assert not bad, f"{mod} imports {bad}"
        if mod == "m3jax.msa.reference":
            assert not {d for d in deps if d != "m3jax.msa"}, f"the MSA maths import {deps}"
        if mod.startswith("m3jax.msa") or mod == "m3jax.sharding":
            assert not deps & upper, f"{mod} imports {deps & upper}"
    assert not {d for d in graph["m3jax.sharding"] if d.startswith("m3jax.msa")}, "sharding imports msa"
