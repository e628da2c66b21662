"""experiments/2026-12-05_block_topk_retrained/retrain.py on a tiny random checkpoint (CPU, byte-level
text): the cells of --cells cross, one indexer_only training per block size, scoring with the
inference-only sweep's code, resume, the side-by-side table and plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

EXP = Path(__file__).resolve().parent.parent / "experiments" / "2026-12-05_block_topk_retrained"


def _load():
    spec = importlib.util.spec_from_file_location("btr_retrain", EXP / "retrain.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


retrain = _load()


def test_cross_is_one_row_and_one_column_through_the_native_cell():
    cells = [c.name for c in retrain.grid_cells("cross", (32, 64, 128), (2, 8, 16), (64, 8))]
    assert cells[0] == "b64_k8"
    assert sorted(cells) == sorted(["b64_k8", "b64_k2", "b64_k16", "b32_k8", "b128_k8"])
    assert len(retrain.grid_cells("full", (32, 64, 128), (2, 8, 16), (64, 8))) == 9


def test_retrain_one_step_scores_resumes_and_reports(byte_text_checkpoint, tmp_path):
    out, plots, runs = tmp_path / "results", tmp_path / "plots", tmp_path / "runs"
    argv = ["--quick", "--checkpoint", str(byte_text_checkpoint), "--ctx", "64", "--steps", "1", "--blocks", "16",
            "--topks", "2", "--n-needles", "1", "--n-docs", "1", "--data-mb", "0.5", "--out", str(out),
            "--plots", str(plots), "--runs", str(runs)]
    assert retrain.main(argv) == 0
    rows = retrain.bt.read_rows(out / retrain.RESULTS_FILE)
    assert [(r["indexer"], r["cell"]) for r in rows] == [("shipped", "dense"), ("retrained", "b16_k2"),
                                                         ("shipped", "b16_k2")]
    assert json.loads((runs / "b16" / "run_args.json").read_text())["mode"] == "indexer_only"
    # One step at the warm-up's first learning rate (0) leaves the index weights as shipped: the retrained
    # model then scores exactly as the shipped one, so nothing but the index branch differs between them.
    shipped, trained = rows[2], rows[1]
    for key in ("ll_tail", "recall_tail", "needle_ll"):
        assert trained[key] == shipped[key], key
    before = (out / retrain.RESULTS_FILE).read_text()
    assert retrain.main(argv) == 0 and (out / retrain.RESULTS_FILE).read_text() == before  # resumed: nothing to do
    table = (out / "side_by_side.md").read_text()
    assert "| b16_k2 | 1 |" in table and (plots / "retrained_vs_inference.png").exists()
    cells = json.loads((out / "side_by_side.json").read_text())["cells"]
    assert cells[0]["inference"]["recall"] == cells[0]["retrained"]["recall"]
