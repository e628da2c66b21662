"""A non-editable install ships everything the README's first steps use.

Builds a wheel of the package from a copy of the sources (so the build leaves nothing in the
repository), installs it into a temporary directory with ``pip install --target``, and runs, from a
temporary working directory so that the repository's own ``m3jax`` cannot shadow it, the README's
Python example parts that need no download (``preset`` -> ``init_random`` -> ``forward``) and
``python -m m3jax.generate`` on the built-in m3-small checkpoint. Dependencies come from the running
environment; nothing is fetched (``--no-index``, ``--no-build-isolation``: setuptools comes with the
``dev`` extra).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.install

README_EXAMPLE = """
import json, sys
from pathlib import Path
import numpy as np
import m3jax

site = Path(sys.argv[1]).resolve()
assert Path(m3jax.__file__).resolve().is_relative_to(site), m3jax.__file__
model = m3jax.init_random(m3jax.preset("m3_tiny"), seed=0)
ids = np.arange(1, 9, dtype=np.int32)[None] % model.config.text.vocab_size
out = m3jax.forward(model, ids, return_block_indices=True)
print(json.dumps({
    "file": m3jax.__file__,
    "presets": m3jax.config.preset_names(),
    "logits": list(out.logits.shape),
    "finite": bool(np.isfinite(np.asarray(out.logits)).all()),
    "msa_layers": sorted(out.block_indices),
}))
"""


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    pytest.importorskip("setuptools", reason="the wheel is built without isolation: pip install -e '.[dev]'")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "m3jax", src / "m3jax", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run(pip + ["wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
         cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("m3jax-*.whl")
    site = tmp_path / "site"
    _run(pip + ["install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)], cwd=tmp_path)

    installed = site / "m3jax"
    for rel in ("configs/m3_tiny.json", "configs/minimax_m3.json", "assets/m3-small/config.json",
                "assets/m3-small/model.safetensors", "assets/m3-small/tokenizer.json"):
        assert (installed / rel).is_file(), f"the wheel does not ship m3jax/{rel}"

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    res = _run([sys.executable, "-c", README_EXAMPLE, str(site)], cwd=work, env=env)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert "m3_tiny" in got["presets"] and "minimax_m3" in got["presets"]
    assert got["logits"][:2] == [1, 8] and got["finite"] and got["msa_layers"], got

    out = work / "generate.json"
    _run([sys.executable, "-m", "m3jax.generate", "--max-new-tokens", "2", "--output-json", str(out)], cwd=work, env=env)
    report = json.loads(out.read_text())
    assert len(report["generated_ids"]) == 2, report
    assert Path(report["config"]).resolve() == (installed / "assets" / "m3-small").resolve(), report["config"]
