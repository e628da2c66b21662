"""experiments/2026-11-29_block_topk/sweep.py: the quick sweep on a tiny random checkpoint (cells,
resume, dense baseline exact), the dry speed sweep (interpret-mode kernels), and the plots."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import m3jax
from m3jax.probe import probe, with_dense_layers
from tests.conftest import tiny_config

SWEEP = Path(__file__).resolve().parent.parent / "experiments" / "2026-11-29_block_topk" / "sweep.py"


def _load_sweep():
    spec = importlib.util.spec_from_file_location("block_topk_sweep", SWEEP)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


sweep = _load_sweep()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick sweep on a saved tiny random checkpoint (no tokenizer.json: token-id mode)."""
    root = tmp_path_factory.mktemp("block_topk")
    ckpt = root / "ckpt"
    m3jax.save_pretrained(m3jax.init_random(tiny_config(), seed=3), ckpt)
    out = root / "results"
    argv = ["--quick", "--checkpoint", str(ckpt), "--out", str(out)]
    assert sweep.main(argv) == 0
    return argv, ckpt, out


def test_grid_has_dense_grid_and_equal_budget_cut():
    names = [c.name for c in sweep.grid_cells()]
    assert names[0] == "dense" and len(names) == len(set(names)) == 1 + 4 * 5 + 1  # (256, 2) is the only new pair
    assert {"b32_k16", "b64_k8", "b128_k4", "b256_k2"} <= set(names)


def test_quick_sweep_cells_and_resume(quick):
    argv, _, out = quick
    rows = sweep.read_rows(out / "quality.jsonl")
    assert [r["cell"] for r in rows] == ["dense", "b32_k2", "b32_k4", "b64_k2", "b64_k4"]
    assert not any("error" in r for r in rows)
    for r in rows:
        assert np.isfinite(r["ll_tail"]) and 0 <= r["recall_tail"] <= 1 + 1e-6
        assert {"needle_acc", "needle_gain", "needle_block_selected", "per_layer"} <= r.keys()
    before = (out / "quality.jsonl").read_text()
    assert sweep.main(argv) == 0  # every cell finished: nothing is recomputed or appended
    assert (out / "quality.jsonl").read_text() == before
    # A lost cell is recomputed on the next run, and only that one.
    kept = [r for r in rows if r["cell"] != "b64_k2"]
    (out / "quality.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    assert sweep.main(argv) == 0
    again = sweep.read_rows(out / "quality.jsonl")
    assert [r["cell"] for r in again][-1] == "b64_k2" and len(again) == len(rows)
    lost = next(r for r in rows if r["cell"] == "b64_k2")
    np.testing.assert_allclose(again[-1]["ll_tail"], lost["ll_tail"], rtol=1e-6)


def test_dense_cell_is_exact_dense_attention(quick):
    argv, ckpt, out = quick
    dense = next(r for r in sweep.read_rows(out / "quality.jsonl") if r["cell"] == "dense")
    assert abs(dense["output_error_tail"]) <= 1e-6
    np.testing.assert_allclose(dense["recall_tail"], 1.0, atol=1e-6)
    for layer in dense["per_layer"].values():
        assert layer["output_error_tail"] <= 1e-6 and abs(layer["recall_tail"] - 1) <= 1e-6
    assert dense["needle_block_selected"] == 1.0
    # Top-k over every block is the with_dense_layers model: same tail log-likelihood.
    model = m3jax.load_pretrained(ckpt, dtype="float32", progress=False)
    args = sweep.parse_args(argv)
    n = (args.n_docs + args.n_needles) * args.ctx
    ids = sweep.random_stream(model.config.text.vocab_size, n, args.seed, sweep.media_ids(model.config))
    ids = ids[: args.ctx][None]
    t = model.config.text
    msa = [i for i in range(t.num_hidden_layers) if t.is_sparse_attention(i)]
    logits = m3jax.forward(m3jax.M3Model(with_dense_layers(model.config, msa), model.params), ids).logits
    ll, _ = sweep._token_logprobs(np.asarray(logits), ids)
    np.testing.assert_allclose(dense["ll_tail"], ll[:, dense["setup"]["tail_start"] - 1 :].mean(), rtol=1e-5)


def test_plot_writes_heatmaps_budget_cut_and_summary(quick, tmp_path):
    _, _, out = quick
    written = sweep.plot(out, tmp_path / "plots")
    names = {p.name for p in written}
    assert {"quality_heatmaps.png", "equal_budget.png", "summary.md"} <= names
    summary = (tmp_path / "plots" / "summary.md").read_text()
    assert "| dense |" in summary and "| b64_k4 |" in summary


def test_speed_dry_records_unsupported_cells(tmp_path):
    assert sweep.main(["--speed", "--dry", "--out", str(tmp_path)]) == 0
    rows = {r["cell"]: r for r in sweep.read_rows(tmp_path / "speed.jsonl")}
    assert "index_block_size 8" in rows["b8_k2"]["unsupported"]
    assert rows["b64_k2"]["ms_msa"] > 0 and rows["b64_k2"]["ms_dense"] > 0 and rows["b64_k2"]["speedup"] > 0
    assert sweep.main(["--speed", "--dry", "--out", str(tmp_path)]) == 0  # resumed: nothing to time
    assert len(sweep.read_rows(tmp_path / "speed.jsonl")) == 2
    assert "speedup.png" in {p.name for p in sweep.plot(tmp_path, tmp_path / "plots")}


def test_probe_share_compilation_gives_the_same_numbers():
    # Layer 1 has a forced block, layer 2 not: they must not share a step, and nothing may change.
    cfg = tiny_config(msa_force_in=((1, 0),))
    model = m3jax.init_random(cfg, seed=1)
    ids = np.random.default_rng(0).integers(3, 97, (1, 40))
    a = probe(model, ids, query_chunk=16)
    b = probe(model, ids, query_chunk=16, share_compilation=True)
    np.testing.assert_array_equal(a.logits, b.logits)
    for i in a.msa_layers:
        for key in ("block_indices", "recall", "output_error"):
            np.testing.assert_array_equal(getattr(a.layers[i], key), getattr(b.layers[i], key))
