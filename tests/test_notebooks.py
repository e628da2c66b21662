"""The notebooks execute top to bottom on the built-in tiny model (CPU), and match their builder."""

import importlib.util
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NB_DIR = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
# Notebooks whose plots must reach the output (02 shows the block x top-k sweep's PNGs; when the sweep's
# results/ are not committed yet it runs a --quick sweep on a tiny random model first).
# 04 shows the committed long-context probe's selection maps, recall vs distance and needles.
MUST_SHOW_IMAGES = {"02_ablations.ipynb", "04_long_context.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    if path.name in MUST_SHOW_IMAGES:
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
        assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3


def test_notebooks_match_their_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", NB_DIR / "build_notebooks.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert sorted(builder.NOTEBOOKS) == [p.name for p in NOTEBOOKS]
    for name, cells in builder.NOTEBOOKS.items():
        nb = nbformat.read(NB_DIR / name, as_version=4)
        assert [(c.cell_type, c.source) for c in nb.cells] == [
            ("markdown" if kind == "md" else "code", src) for kind, src in cells
        ], f"{name} is out of date: python notebooks/build_notebooks.py {name}"
