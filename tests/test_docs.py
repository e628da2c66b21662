"""The docs agree with the tree: README's layout table has a row for every module and package under
m3jax/ (a package's row names each of its modules), and every m3jax path it names exists; every test
body of tests/pallas says which machine it describes (README, "On a new GPU")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "m3jax"


def layout_rows() -> dict[str, str]:
    """{first cell's path: second cell} of the table under README's "## Layout" heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.fullmatch(r"\| `([^`]+)` \| (.*) \|", line.strip())
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_layout_table_lists_every_module():
    rows = layout_rows()
    missing = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if f.parent == PKG:  # a top-level module: a row of its own
            ok = rel in rows
        elif f.name == "__init__.py":  # a package: a row of its own
            ok = f"{f.parent.relative_to(ROOT).as_posix()}/" in rows
        else:  # a module inside a package: named in its package's row
            ok = f"`{f.name}`" in rows.get(f"{f.parent.relative_to(ROOT).as_posix()}/", "")
        if not ok:
            missing.append(rel)
    assert not missing, f"README's layout table does not list {missing}"


def test_layout_table_names_only_what_exists():
    stale = []
    for path, what in layout_rows().items():
        if not path.startswith("m3jax/"):
            continue
        if not (ROOT / path).exists():
            stale.append(path)
        elif path.endswith("/"):
            named = re.findall(r"`([\w.]+\.py)`", what)
            stale += [f"{path}{name}" for name in named if not (ROOT / path / name).exists()]
    assert not stale, f"README's layout table names {stale}, which do not exist"


def test_every_kernel_test_names_its_machine():
    # tests/pallas runs on a CPU (CI) and on GPUs: each test body says which ("# Machine: ..." or a
    # docstring line), so an assertion that holds on one only is seen as such.
    silent = []
    for path in sorted((ROOT / "tests" / "pallas").glob("test_*.py")):
        src = path.read_text(encoding="utf-8")
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if "Machine:" not in ast.get_source_segment(src, node):
                    silent.append(f"{path.name}::{node.name}")
    assert not silent, f"test bodies that do not say which machine they describe: {silent}"
