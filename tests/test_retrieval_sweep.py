"""experiments/2026-12-01_block_topk_retrieval: sweep.py (quality cells, order, time budget, resume,
plots) and fp8_index.py on a tiny random checkpoint (CPU, byte-level text), the path the H200 runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

EXP = Path(__file__).resolve().parent.parent / "experiments" / "2026-12-01_block_topk_retrieval"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"btr_{name}", EXP / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


sweep = _load("sweep")


def test_cell_order_puts_dense_native_and_budget_first():
    cells = sweep.bt.grid_cells((16, 32), (2, 4, 8), 64)
    order = [c.name for c in sweep.cell_order(cells, 32, 4, 64)]
    assert order[:4] == ["dense", "b32_k4", "b16_k4", "b32_k2"] and sorted(order) == sorted(c.name for c in cells)


def test_sweep_on_a_checkpoint_budget_resume_and_plot(byte_text_checkpoint, tmp_path):
    out = tmp_path / "results"
    argv = ["--quick", "--checkpoint", str(byte_text_checkpoint), "--ctx", "128", "--n-needles", "1", "--blocks", "16", "--topks", "2",
            "--budget", "0", "--out", str(out)]
    assert sweep.main(argv + ["--max-seconds", "1e-9"]) == 0  # budget spent before the first cell: nothing run
    assert not (out / "quality.jsonl").exists()
    assert sweep.main(argv) == 0
    rows = sweep.bt.read_rows(out / "quality.jsonl")
    assert [r["cell"] for r in rows] == ["dense", "b16_k2"] and not any("error" in r for r in rows)
    for r in rows:
        assert r["setup"]["needle"] == "kv-retrieval" and r["setup"]["checkpoint"] == "tiny"
        assert {"ll_tail", "recall_tail", "needle_acc", "needle_gain", "needle_block_selected"} <= r.keys()
    assert abs(rows[0]["recall_tail"] - 1) < 1e-6 and rows[0]["needle_block_selected"] == 1.0
    before = (out / "quality.jsonl").read_text()
    assert sweep.main(argv) == 0 and (out / "quality.jsonl").read_text() == before  # resumed: nothing to do
    plots = tmp_path / "plots"
    assert sweep.main(["--plot", "--out", str(out), "--plots", str(plots)]) == 0
    summary = (plots / "summary.md").read_text()
    assert "| dense |" in summary and "| b16_k2 |" in summary and (plots / "quality_heatmaps.png").exists()


def test_fp8_index_on_a_checkpoint(byte_text_checkpoint, tmp_path):
    fp8 = _load("fp8_index")
    out = tmp_path / "fp8.json"
    assert fp8.main(["--checkpoint", str(byte_text_checkpoint), "--ctx", "128", "--n-docs", "1", "--trials", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert 0 <= res["rows_equal"] <= 1 and set(res["rows_equal_per_layer"]) == {"1", "2"}
    for name in ("bfloat16", fp8.FP8):
        assert 0 < res[name]["recall_mean"] <= 1 + 1e-6 and 0 <= res[name]["needle_accuracy"] <= 1


def test_config_override_parses():
    args = sweep.parse_args(["--config-override", "index_score_dtype=float8_e4m3fn"])
    assert args.config_override == {"index_score_dtype": "float8_e4m3fn"}
