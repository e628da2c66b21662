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


@pytest.mark.parametrize("key_tile", [4, 12, 4096])
def test_dense_block_mass_equals_dense_softmax(key_tile):
    # The streamed pass (key tiles merged by LSE, future tiles skipped) against the dense [C, S] softmax.
    import jax
    import jax.numpy as jnp

    from m3jax.msa import reference as msa
    from m3jax.probe import dense_block_mass

    b, s, c, n, kh, h, bs = 2, 37, 9, 4, 2, 8, 4
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.normal(size=shape), jnp.float32) for shape in ((b, c, n, h), (b, s, kh, h), (b, s, kh, h)))
    q_pos = jnp.asarray([np.arange(10, 10 + c), np.arange(28, 28 + c)], jnp.int32)  # the second ends at key 36
    o, mass = dense_block_mass(q, k, v, q_pos, bs, key_tile)
    assert_close(o, msa.dense_mask_attention(q, k, v, None, q_pos, bs), "float32", "streamed dense output")
    logits = jnp.einsum("bcnh,bsnh->bncs", q, jnp.repeat(k, n // kh, 2), precision=msa.HIGHEST) * h**-0.5
    p = jax.nn.softmax(jnp.where(jnp.arange(s) <= q_pos[:, None, :, None], logits, -jnp.inf), -1)
    want = jnp.pad(p, [(0, 0)] * 3 + [(0, 3)]).reshape(b, n, c, -1, bs).sum(-1)
    np.testing.assert_allclose(mass, want, atol=1e-6)
    # Recall of a selection: the probe's former dense form (softmax masked to the selected blocks' keys)
    # equals the streamed block mass summed over the selected blocks.
    sel = jnp.asarray(r.integers(-1, -(-s // bs), (b, kh, c, 3)), jnp.int32)
    hit = jax.nn.one_hot(sel, -(-s // bs) + 1, dtype=jnp.bool_)[..., :-1].any(-2)  # [B, K, C, nb]
    hit = jnp.repeat(hit, n // kh, axis=1)
    dense = jnp.sum(jnp.where(jnp.repeat(hit, bs, -1)[..., :s], p, 0.0), -1)
    np.testing.assert_allclose(jnp.sum(jnp.where(hit, mass, 0.0), -1), dense, atol=1e-5)


def test_streamed_recall_by_distance_accounts_for_all_mass(setup):
    # Key tiles of one block (the streamed pass at its finest, many tiles skipped): the by-distance sums
    # hold every query row's mass (1 each) and exactly the recall.
    model, ids = setup
    res = probe(model, ids, query_chunk=16, key_tile=4)
    t = model.config.text
    n_rows = ids.shape[0] * t.num_attention_heads * ids.shape[1]
    for i in res.msa_layers:
        p = res.layers[i]
        assert (p.recall > 0).all() and (p.recall <= 1 + 1e-5).all()
        mass, recall = res.recall_by_distance(i)
        np.testing.assert_allclose(mass.sum(), n_rows, rtol=1e-5)
        np.testing.assert_allclose(p.selected_mass_by_distance.sum(), p.recall.sum(), rtol=1e-5)
        np.testing.assert_allclose(recall[0], 1.0, atol=1e-6)  # the own block is always selected
        sel_map = res.selection_map(i, group=1, rows=8, cols=4)
        assert sel_map.shape == (8, 4) and (sel_map >= 0).all() and (sel_map <= 1).all()


def test_probe_on_the_kernels_path():
    # attention_impl="pallas": selections and the MSA output from the kernels (interpret mode here),
    # the metrics from the same streamed pass; in fp32 both paths select the same blocks.
    cfg = tiny_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64, index_n_heads=2,
                      index_head_dim=64, index_block_size=16, index_topk_blocks=2, num_hidden_layers=2,
                      layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "dense"))
    model = m3jax.init_random(cfg, seed=0)
    ids = np.random.default_rng(0).integers(3, 90, (1, 64))
    ref = probe(model, ids, query_chunk=32)
    pal = probe(m3jax.M3Model(cfg.replace(attention_impl="pallas"), model.params), ids, query_chunk=32, key_tile=32)
    assert same_sets(pal.layers[1].block_indices, ref.layers[1].block_indices) == 0
    np.testing.assert_allclose(pal.layers[1].recall, ref.layers[1].recall, atol=1e-5)
    np.testing.assert_allclose(pal.layers[1].output_error, ref.layers[1].output_error, atol=1e-4)
    assert_close(pal.logits, ref.logits, "float32", "kernels-path probe logits")
