"""experiments/2026-12-01_probe_long/probe_long.py on a tiny random checkpoint (CPU, reference path):
the multi-needle row, the JSON it writes, and the plots the notebook draws from it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

import m3jax
from m3jax import data, needle
from tests.conftest import tiny_config

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "2026-12-01_probe_long" / "probe_long.py"


def _load():
    spec = importlib.util.spec_from_file_location("probe_long", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_multi_needle_row():
    enc = data.text_encoder(None, 256)
    stream = np.arange(5000, dtype=np.int32) + 1000  # filler ids above the bytes of the planted lines
    row = needle.multi_needle_row(stream, 600, [0.1, 0.5, 0.9], np.random.default_rng(0), enc)
    assert row.tokens.shape == (600,) and len(set(row.keys)) == 3
    text = row.tokens[row.tokens >= 1000]
    assert np.array_equal(np.diff(text), np.ones(len(text) - 1))  # one contiguous window around the lines
    for at, q, n in zip(row.value_at, row.query_value_at, row.value_len):
        assert np.array_equal(row.tokens[at : at + n], row.tokens[q : q + n]) and q > at
    assert row.query_value_at[-1] + row.value_len[-1] == 600  # the row ends with the last value
    assert row.value_at == sorted(row.value_at) and abs(row.value_at[1] - 300) < 60


def test_probe_long_cpu(tmp_path):
    mod = _load()
    cfg = tiny_config(vocab_size=300, index_block_size=16, index_topk_blocks=2).replace(image_token_id=298,
                                                                                        video_token_id=299)
    ckpt = tmp_path / "tiny"
    m3jax.save_pretrained(m3jax.init_random(cfg, seed=0), ckpt)
    out = tmp_path / "out"
    argv = ["--checkpoint", str(ckpt), "--ctx", "384", "--dtype", "float32", "--query-chunk", "64", "--key-tile", "48",
            "--depths", "0.2", "0.7", "--out", str(out)]
    assert mod.main(argv) == 0
    res = json.loads((out / "probe_384.json").read_text())
    assert res["attention_impl"] == "reference" and res["msa_layers"] == [1, 2] and res["memory"]
    assert [r["layer"] for r in res["summary"]] == [1, 2]
    nb = 384 // 16
    for d in res["recall_vs_distance"].values():
        assert d["bins"][0] == [0, 1] and d["bins"][-1][1] == nb
        np.testing.assert_allclose(sum(d["dense_mass_share"]), 1.0, rtol=1e-5)
        np.testing.assert_allclose(d["recall"][0], 1.0, atol=1e-6)  # the own block is always selected
    assert [n["depth"] for n in res["needles"]] == [0.2, 0.7]
    for n in res["needles"]:
        assert set(n["block_selected"]) == {"1", "2"} and all(len(v) == 2 for v in n["block_selected"].values())
        assert n["distance_blocks"] > 0 and isinstance(n["correct"], bool)
    assert set(res["selection_maps"]) == {"1", "2"}
    assert np.asarray(res["selection_maps"]["1"]["0"]).shape == (128, nb)
    names = {p.name for p in out.iterdir()}
    assert {"probe_384_selection_maps.png", "probe_384_recall_vs_distance.png", "probe_384_needles.png",
            "probe_384_summary.md"} <= names
