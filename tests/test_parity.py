"""Parity with the transformers oracle (fixtures from tests/oracle/make_fixtures.py).

Each fixture directory is a real HF checkpoint saved by transformers' save_pretrained (official
tensor names; one sharded with an index, one MXFP8 that we quantised) plus the oracle's fp32
logits, per-layer MSA block selections and vision features.
"""

from __future__ import annotations

import numpy as np
import pytest

import m3jax
from m3jax.vision import encode_media
from tests.conftest import ORACLE_CONFIGS, assert_close, same_sets

MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _run(oracle_dir, name, impl):
    fx = np.load(oracle_dir / name / "fixture.npz")
    model = m3jax.load_pretrained(oracle_dir / name, dtype="float32", attention_impl=impl, progress=False)
    media = {k: fx[k] for k in MEDIA_KEYS if k in fx}
    out = m3jax.forward(model, fx["input_ids"], return_block_indices=True, **media)
    return fx, model, out


@pytest.mark.oracle
@pytest.mark.parametrize("impl", ["reference", "dense_mask"])
@pytest.mark.parametrize("name", ORACLE_CONFIGS)
def test_logits_and_selections_match_transformers(oracle_dir, name, impl):
    fx, model, out = _run(oracle_dir, name, impl)
    assert_close(out.logits, fx["logits"], "float32", f"{name} logits")
    sparse_layers = [i for i in range(model.config.text.num_hidden_layers) if model.config.text.is_sparse_attention(i)]
    assert sorted(out.block_indices) == sparse_layers
    for layer in sparse_layers:
        ref = fx[f"block_indices_{layer}"]
        got = np.asarray(out.block_indices[layer])
        assert got.shape[:3] == ref.shape[:3]
        assert same_sets(got, ref) == 0, f"{name} layer {layer}: selections differ"


@pytest.mark.oracle
@pytest.mark.parametrize("name,kind", [("image", "image"), ("video", "image"), ("video", "video")])
def test_vision_features_match_transformers(oracle_dir, name, kind):
    fx = np.load(oracle_dir / name / "fixture.npz")
    model = m3jax.load_pretrained(oracle_dir / name, dtype="float32", progress=False)
    pix_key, grid_key = ("pixel_values", "image_grid_thw") if kind == "image" else ("pixel_values_videos", "video_grid_thw")
    grid = tuple(tuple(int(v) for v in row) for row in fx[grid_key])
    hidden, tokens = encode_media(fx[pix_key], grid, model.params, model.config)
    assert_close(hidden, fx[f"vision_hidden_{kind}"], "float32", f"{name} {kind} tower")
    assert_close(tokens, fx[f"{kind}_features"], "float32", f"{name} {kind} projected tokens")


@pytest.mark.oracle
def test_oracle_fixtures_exercise_what_they_claim(oracle_dir):
    """Guards the fixtures themselves: non-trivial selections, several shards, split video, MXFP8."""
    fx = np.load(oracle_dir / "text_mixed" / "fixture.npz")
    cfg = m3jax.load_config(oracle_dir / "text_mixed").text
    t = fx["input_ids"].shape[1]
    assert fx["input_ids"].shape[0] > 1
    assert t > 2 * cfg.index_topk_blocks * cfg.index_block_size
    assert cfg.num_local_experts > cfg.num_experts_per_tok
    assert (oracle_dir / "text_mixed" / "model.safetensors.index.json").exists()
    assert len(set(cfg.layer_types)) == 2 and len(set(cfg.mlp_layer_types)) == 2
    last_rows = fx["block_indices_0"][:, :, -1]
    assert (last_rows >= 0).sum(-1).min() == cfg.index_topk_blocks  # full top-k used at the end
    video = np.load(oracle_dir / "video" / "fixture.npz")
    assert len(video["video_grid_thw"]) >= 2  # one video split into attention segments
    assert m3jax.load_config(oracle_dir / "mxfp8").quantization == "mxfp8"
