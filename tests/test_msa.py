"""MSA reference pieces against independent brute-force versions on random inputs."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

from m3jax import msa
from tests.conftest import assert_close, tiny_config


def brute_select(scores, q_pos, block_size, topk, local_blocks, init_blocks):
    """Per row: forced blocks, then the rest by (score desc, id asc); returned as sets."""
    b, g, c, nb = scores.shape
    out = np.empty((b, g, c), dtype=object)
    for bi, gi, ci in np.ndindex(b, g, c):
        own = q_pos[bi, ci] // block_size
        visible = list(range(own + 1))
        forced = {j for j in visible if j > own - local_blocks} | {j for j in visible if j < init_blocks}
        rest = sorted((j for j in visible if j not in forced), key=lambda j: (-scores[bi, gi, ci, j], j))
        out[bi, gi, ci] = forced | set(rest[: max(topk - len(forced), 0)])
    return out


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 70),
    block=st.sampled_from([1, 4, 8, 16]),
    topk=st.integers(1, 9),
    local=st.integers(1, 3),
    init=st.integers(0, 2),
    ties=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_select_blocks_matches_brute_force(t, block, topk, local, init, ties, seed):
    if local + init > topk:
        local, init = 1, 0
    rng = np.random.default_rng(seed)
    nb = -(-t // block)
    q_pos = np.sort(rng.choice(t, size=(2, min(t, 5)), replace=True), axis=1)
    scores = rng.normal(size=(2, 3, q_pos.shape[1], nb)).astype(np.float32)
    if ties:  # coarse values: many exact ties, which must go to the lower block id
        scores = np.round(scores)
    own = q_pos // block
    scores = np.where(np.arange(nb)[None, None, None] > own[:, None, :, None], -np.inf, scores)
    got = np.asarray(
        msa.select_blocks(jnp.asarray(scores), jnp.asarray(q_pos), block_size=block, topk=topk,
                          local_blocks=local, init_blocks=init)
    )
    ref = brute_select(scores, q_pos, block, topk, local, init)
    assert got.shape == (2, 3, q_pos.shape[1], topk)
    for idx in np.ndindex(ref.shape):
        row = got[idx]
        valid = row[row >= 0]
        assert (row[len(valid):] == -1).all(), f"-1 padding must follow the valid entries: {row}"
        assert len(set(valid.tolist())) == len(valid), f"duplicate block in {row}"
        assert set(valid.tolist()) == ref[idx], (idx, row, ref[idx])
        assert valid[0] == q_pos[idx[0], idx[2]] // block, "own block first (transformers' order)"


def test_block_scores_matches_naive():
    rng = np.random.default_rng(0)
    b, c, hi, hx, s, bs = 2, 9, 3, 8, 37, 8
    iq = rng.normal(size=(b, c, hi, hx)).astype(np.float32)
    ik = rng.normal(size=(b, s, hx)).astype(np.float32)
    q_pos = np.stack([np.arange(28, 37), np.arange(0, 9)])
    got = np.asarray(msa.block_scores(jnp.asarray(iq), jnp.asarray(ik), jnp.asarray(q_pos), bs))
    nb = -(-s // bs)
    for bi, ci, h, j in np.ndindex(b, c, hi, nb):
        keys = [k for k in range(j * bs, min((j + 1) * bs, s)) if k <= q_pos[bi, ci]]
        want = max((iq[bi, ci, h] @ ik[bi, k] for k in keys), default=-np.inf)
        np.testing.assert_allclose(got[bi, h, ci, j], want, rtol=1e-5, atol=1e-5)


def _random_qkv(rng, b, t, n, k, h, dtype=np.float32):
    q = rng.normal(size=(b, t, n, h)).astype(dtype)
    kk = rng.normal(size=(b, t, k, h)).astype(dtype)
    v = rng.normal(size=(b, t, k, h)).astype(dtype)
    return q, kk, v


def _random_selection(rng, b, k, t, block, topk):
    """Valid MSA-shaped selections: own block + random distinct earlier blocks, -1 padded."""
    out = -np.ones((b, k, t, topk), np.int32)
    for bi, gi, ti in np.ndindex(b, k, t):
        own = ti // block
        hist = rng.permutation(own)[: topk - 1]
        row = [own, *hist.tolist()]
        out[bi, gi, ti, : len(row)] = row
    return out


@pytest.mark.parametrize("t,block,topk", [(37, 4, 3), (64, 8, 2), (20, 16, 4), (5, 8, 16)])
def test_sparse_attention_gather_equals_dense_mask(t, block, topk):
    rng = np.random.default_rng(t)
    b, n, k, h = 2, 6, 2, 16
    q, kk, v = _random_qkv(rng, b, t, n, k, h)
    sel = _random_selection(rng, b, k, t, block, topk)
    pos = np.broadcast_to(np.arange(t), (b, t))
    got = msa.sparse_attention(q, kk, v, jnp.asarray(sel), jnp.asarray(pos), block)
    ref = msa.dense_mask_attention(q, kk, v, jnp.asarray(sel), jnp.asarray(pos), block)
    assert_close(got, ref, "float32", "gathered vs dense-mask MSA")


def test_sparse_attention_bf16_close_to_fp32():
    rng = np.random.default_rng(1)
    b, t, n, k, h, block, topk = 1, 48, 4, 2, 32, 8, 3
    q, kk, v = _random_qkv(rng, b, t, n, k, h)
    sel = jnp.asarray(_random_selection(rng, b, k, t, block, topk))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    ref = msa.sparse_attention(q, kk, v, sel, pos, block)
    got = msa.sparse_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, kk, v)), sel, pos, block)
    assert got.dtype == jnp.bfloat16
    assert_close(got.astype(jnp.float32), ref, "bfloat16", "bf16 MSA")


def test_msa_is_dense_causal_when_all_blocks_fit():
    """With T <= topk * block every visible block is selected: MSA == causal attention."""
    rng = np.random.default_rng(2)
    b, t, n, k, h, block, topk = 2, 30, 4, 2, 8, 4, 8
    q, kk, v = _random_qkv(rng, b, t, n, k, h)
    iq = rng.normal(size=(b, t, k, h)).astype(np.float32)
    ik = rng.normal(size=(b, t, h)).astype(np.float32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    sel = msa.select_blocks(msa.block_scores(iq, ik, pos, block), pos, block_size=block, topk=topk)
    got = msa.sparse_attention(q, kk, v, sel, pos, block)
    # Independent causal attention with a materialised [T, T] mask.
    qg = q.reshape(b, t, k, n // k, h)
    logits = np.einsum("btkgh,bskh->bkgts", qg, kk) / np.sqrt(h)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h)
    assert_close(got, ref, "float32", "MSA vs causal")


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
def test_query_chunking_is_invisible(chunk):
    rng = np.random.default_rng(3)
    b, t, n, k, h = 2, 29, 4, 2, 8
    q, kk, v = _random_qkv(rng, b, t, n, k, h)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    full = msa.dense_mask_attention(q, kk, v, None, pos, 4)
    outs, merge = msa.map_query_chunks(lambda qp, qc: msa.dense_mask_attention(qc, kk, v, None, qp, 4), chunk, pos, jnp.asarray(q))
    assert_close(merge(outs, 1), full, "float32", f"chunk={chunk}")


def test_future_keys_never_leak():
    """Changing keys/values after position t must not change outputs at positions <= t."""
    rng = np.random.default_rng(4)
    b, t, n, k, h, block, topk, cut = 1, 40, 4, 2, 8, 4, 3, 22
    q, kk, v = _random_qkv(rng, b, t, n, k, h)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    sel = jnp.asarray(_random_selection(rng, b, k, t, block, topk))
    a = msa.sparse_attention(q, kk, v, sel, pos, block)
    kk2, v2 = kk.copy(), v.copy()
    kk2[:, cut + 1:] = rng.normal(size=kk2[:, cut + 1:].shape)
    v2[:, cut + 1:] = rng.normal(size=v2[:, cut + 1:].shape)
    b2 = msa.sparse_attention(q, kk2, v2, sel, pos, block)
    np.testing.assert_array_equal(np.asarray(a)[:, : cut + 1], np.asarray(b2)[:, : cut + 1])


def test_a_new_variant_is_one_registry_entry(monkeypatch):
    """A sparse-attention variant is one function and one :data:`m3jax.msa.layer.VARIANTS` entry (plus its
    name in ``config.ATTENTION_IMPLS``): here the reference maths over the whole sequence at once, no query
    chunks. The model runs it through the same route and matches the chunked reference in fp32."""
    import m3jax
    from m3jax import config
    from m3jax.msa import layer, reference

    def whole_sequence(q, k, v, iq, ik, q_pos, cfg, layer_id):
        sel = layer.select(iq, ik, q_pos, cfg.text, layer_id)
        return reference.sparse_attention(q, k, v, sel, q_pos, cfg.text.index_block_size), sel

    monkeypatch.setitem(layer.VARIANTS, "whole_sequence", layer.Variant(gathered=whole_sequence))
    monkeypatch.setattr(config, "ATTENTION_IMPLS", config.ATTENTION_IMPLS + ("whole_sequence",))
    cfg = tiny_config(index_block_size=4, index_topk_blocks=2).replace(attention_chunk=8)
    ref = m3jax.init_random(cfg.replace(attention_impl="reference"), seed=1)
    new = m3jax.M3Model(ref.config.replace(attention_impl="whole_sequence"), ref.params)
    ids = np.random.default_rng(2).integers(0, 80, (2, 21))
    want = m3jax.forward(ref, ids, return_block_indices=True)
    got = m3jax.forward(new, ids, return_block_indices=True)
    assert_close(got.logits, want.logits, what="logits")  # fp32
    assert want.block_indices and all(np.array_equal(got.block_indices[i], want.block_indices[i])
                                      for i in want.block_indices)


@pytest.mark.parametrize("index_head_dim,dtype", [(64, "bfloat16"), (32, "float32")])
def test_projections_normed_together_equal_one_by_one(index_head_dim, dtype):
    # project_qkv norms and rotates q, k and the index q/k in one computation per head size (one launch
    # each at decode on the GPU); head by head that is the per-projection norm and RoPE, exactly on CPU.
    import jax

    import m3jax
    from m3jax.layers import apply_rope, rms_norm, rope_angles
    from m3jax.model import index_branch, project_qkv
    from m3jax.moe import linear

    cfg = tiny_config(head_dim=64, index_head_dim=index_head_dim)
    t = cfg.text
    lp = m3jax.init_random(cfg, seed=3, dtype=dtype).params["text"]["layers"][1]
    x = jax.random.normal(jax.random.key(0), (2, 3, t.hidden_size), dtype)
    angles = rope_angles(jnp.arange(3)[None] + jnp.array([[5], [900]]), t.rotary_dim, t.rope_theta)

    def alone(w, norm):
        return apply_rope(rms_norm(linear(x, w), norm, t.rms_norm_eps), angles)

    q, k, v, iq, ik = project_qkv(x, lp, angles, t, sparse=True)
    a, i = lp["attn"], lp["index"]
    want = [alone(a["wq"], a["q_norm"]), alone(a["wk"], a["k_norm"]), linear(x, a["wv"]),
            alone(i["wq"], i["q_norm"]), alone(i["wk"][:, None], i["k_norm"])[:, :, 0]]
    for got, w in zip((q, k, v, iq, ik), want):
        assert got.shape == w.shape and got.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(w, np.float32))
    for got, w in zip(index_branch(x, i, angles, t), want[3:]):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(w, np.float32))
