"""Probe API and configuration interventions."""

from __future__ import annotations

import numpy as np
import pytest

import m3jax
from m3jax.probe import probe, with_dense_layers
from tests.conftest import assert_close, same_sets, tiny_config


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(index_block_size=4, index_topk_blocks=3)
    model = m3jax.init_random(cfg, seed=2)
    ids = np.random.default_rng(0).integers(0, 80, (2, 45))
    return model, ids


def test_probe_matches_forward_and_metrics_are_sane(setup):
    model, ids = setup
    ref = m3jax.forward(model, ids, return_block_indices=True)
    res = probe(model, ids, query_chunk=16, keep_scores=True)
    assert_close(res.logits, ref.logits, "float32", "probe logits")
    assert res.msa_layers == sorted(ref.block_indices)
    t = ids.shape[1]
    for i in res.msa_layers:
        p = res.layers[i]
        assert same_sets(p.block_indices, ref.block_indices[i]) == 0
        assert p.recall.shape == (2, model.config.text.num_attention_heads, t)
        assert (p.recall > 0).all() and (p.recall <= 1 + 1e-5).all()
        # queries whose whole past fits in top-k blocks lose nothing
        t_fit = model.config.text.index_topk_blocks * model.config.text.index_block_size
        np.testing.assert_allclose(p.recall[..., :t_fit], 1.0, atol=1e-5)
        assert (p.output_error[:, :t_fit] < 1e-5).all() and (p.output_error[:, t_fit:] > 0).any()
        assert np.isnan(p.margin[..., :t_fit]).all() and (p.margin[..., t_fit:][~np.isnan(p.margin[..., t_fit:])] >= 0).all()
        assert p.block_scores.shape[-1] == -(-t // model.config.text.index_block_size)
        hist = res.distance_histogram(i)
        assert hist[0] == 2 * model.config.text.num_key_value_heads * t  # own block always selected
        g = res.jaccard_groups(i)
        assert g.shape == (2, 2) and np.allclose(np.diag(g), 1) and (0 <= g).all() and (g <= 1).all()
    layers, jl = res.jaccard_layers()
    assert jl.shape == (len(layers), len(layers))
    moe_layers = [i for i in range(model.config.text.num_hidden_layers) if model.config.text.is_moe(i)]
    for i in moe_layers:
        assert res.layers[i].experts.shape == (2, t, model.config.text.num_experts_per_tok)
    assert len(res.summary()) == len(res.msa_layers)


def test_dense_layer_intervention_is_the_in_model_oracle(setup):
    model, ids = setup
    dense = m3jax.M3Model(with_dense_layers(model.config, [1, 2]), model.params)
    out = m3jax.forward(dense, ids, return_block_indices=True)
    assert out.block_indices == {}
    big_k = m3jax.M3Model(model.config.replace_text(index_topk_blocks=64), model.params)
    assert_close(m3jax.forward(big_k, ids).logits, out.logits, "float32", "top-k >= all blocks == dense")


def test_force_blocks_in_and_out(setup):
    model, ids = setup
    cfg = model.config.replace_text(msa_force_in=((1, 0),), msa_force_out=((2, 0),))
    out = m3jax.forward(m3jax.M3Model(cfg, model.params), ids, return_block_indices=True)
    bs = cfg.text.index_block_size
    sel1, sel2 = np.asarray(out.block_indices[1]), np.asarray(out.block_indices[2])
    assert (sel1 == 0).any(-1).all(), "block 0 forced into every selection of layer 1"
    own = np.arange(ids.shape[1]) // bs
    assert not (sel2[..., own > 0, :] == 0).any(), "block 0 forced out of layer 2 (except its own queries)"
    base = m3jax.forward(model, ids, return_block_indices=True)
    assert same_sets(np.asarray(base.block_indices[3 - 1]), sel2) > 0  # the intervention changed something
