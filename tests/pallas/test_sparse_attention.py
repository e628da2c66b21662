"""MSA block-sparse prefill attention kernels vs the jnp reference, in GPU interpret mode on CPU.

Interpret mode simulates every TMA, barrier and warpgroup op in Python (with the race detector on), so
shapes are tiny: N=16 heads, K=2 KV heads (G=8), H=64, block 64. Tolerances: docs/MSA.md §4.3 (bf16 out
3e-2, LSE 1e-3). fp32 inputs are rounded to bf16 before the tensor-core MMAs (bf16 kernels), so they
are checked at the bf16 output tolerance, and their LSE against the reference on bf16-rounded q/k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3jax import msa
from m3jax.pallas import _backend
from m3jax.pallas.sparse_attention import SparseAttentionConfig, csr, sparse_attention

N, K, H, BS = 16, 2, 64, 64
TOL = {"out": 3e-2, "lse": 1e-3}


def make_inputs(b, t, prefixes, topk, dtype, seed=0, shuffle=False):
    """Random q/k/v, per-batch positions prefix_b + arange(t) (block-aligned prefixes), MSA selections."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    s = max(prefixes) + t
    q = jax.random.normal(ks[0], (b, t, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, K, H), jnp.float32).astype(dtype)
    q_pos = jnp.asarray(prefixes, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    scores = msa.block_scores(jax.random.normal(ks[3], (b, t, K, 16)), jax.random.normal(ks[4], (b, s, 16)), q_pos, BS)
    block_idx = msa.select_blocks(scores, q_pos, block_size=BS, topk=topk)
    if shuffle:  # valid entries in any order, -1 slots anywhere
        block_idx = block_idx[..., ::-1]
    return q, k, v, block_idx, q_pos


def check(impl, q, k, v, block_idx, q_pos):
    _backend.reset_interpret_state()
    out, lse = sparse_attention(q, k, v, block_idx, q_pos, block_size=BS, implementation=impl, return_lse=True)
    out = jax.block_until_ready(out)
    assert not _backend.interpret_races_found(), "race detector fired"
    ref, ref_lse = sparse_attention(q, k, v, block_idx, q_pos, block_size=BS, implementation="reference",
                                    return_lse=True)
    if q.dtype == jnp.float32:  # the kernels round fp32 q/k to bf16 for the MMA: LSE vs that rounding
        rnd = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
        ref_lse = sparse_attention(rnd(q), rnd(k), v, block_idx, q_pos, block_size=BS, implementation="reference",
                                   return_lse=True)[1]
    assert out.dtype == q.dtype and out.shape == q.shape
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=TOL["out"], rtol=TOL["out"])
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=TOL["lse"], rtol=TOL["lse"])


@pytest.mark.parametrize(
    "impl,dtype,b,t,prefixes,topk,shuffle",
    [
        # batch 0: prefix 0, one visible block < topk; batch 1: block-aligned prefix (chunked prefill);
        # T not a multiple of the block; slots reversed (valid ids in any order, -1 first).
        # The fp32 cases share the bf16 shapes so they reuse the compiled (interpreted) kernels.
        ("kv_major", jnp.bfloat16, 2, 10, (0, 64), 3, True),
        ("kv_major", jnp.float32, 2, 10, (0, 64), 3, False),
        ("query_major", jnp.bfloat16, 2, 3, (0, 128), 3, True),
        ("query_major", jnp.float32, 2, 3, (0, 128), 3, False),
    ],
)
def test_matches_reference(impl, dtype, b, t, prefixes, topk, shuffle):
    check(impl, *make_inputs(b, t, prefixes, topk, dtype, shuffle=shuffle))


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(t=st.integers(1, 9), prefix_blocks=st.integers(0, 2), topk=st.integers(1, 3), seed=st.integers(0, 99))
def test_kv_major_fuzz_lengths(t, prefix_blocks, topk, seed):
    check("kv_major", *make_inputs(1, t, (prefix_blocks * BS,), topk, jnp.bfloat16, seed=seed))


def test_plan_covers_every_edge_once():
    """The CSR/work list (pure jnp) puts each valid (query, slot) on exactly one padded edge of its row."""
    b, t, topk, tq, tpi = 2, 40, 3, 4, 2
    _, _, _, block_idx, q_pos = make_inputs(b, t, (0, 128), topk, jnp.float32, shuffle=True)
    nb = -(-(128 + t) // BS)
    build = jax.jit(csr.build_plan, static_argnames=("num_blocks", "block_size", "tq", "tiles_per_item"))
    plan = build(block_idx, q_pos, num_blocks=nb, block_size=BS, tq=tq, tiles_per_item=tpi)
    e_pad, n_cap = csr.capacities(b, t, K, nb, topk, tq, tpi)
    bi, ep = np.asarray(block_idx), np.asarray(plan.epos)
    assert ((ep >= 0) == (bi >= 0)).all()
    items = np.asarray(plan.items)[: int(plan.n_items[0])]
    assert len(items) <= n_cap
    # tile -> (kv head, batch, block) from the work list
    owner = {}
    for hh, bb, blk, t0, nt in items:
        assert 1 <= nt <= tpi
        for tile in range(t0, t0 + nt):
            assert (hh, tile) not in owner
            owner[(hh, tile)] = (bb, blk)
    qtok, qlim = np.asarray(plan.qtok), np.asarray(plan.qlim)
    seen = set()
    for bb, hh, tt, ss in zip(*np.nonzero(bi >= 0)):
        e = ep[bb, hh, tt, ss]
        assert e < e_pad and (hh, e) not in seen
        seen.add((hh, e))
        assert owner[(hh, e // tq)] == (bb, bi[bb, hh, tt, ss])
        assert qtok[hh, e] == tt
        assert qlim[hh, e] == q_pos[bb, tt] - bi[bb, hh, tt, ss] * BS


def test_rejects_unsupported_shapes():
    q = jnp.ones((1, 4, N, H), jnp.bfloat16)
    k = v = jnp.ones((1, 4, K, H), jnp.bfloat16)
    block_idx, q_pos = jnp.zeros((1, K, 4, 2), jnp.int32), jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError):
        sparse_attention(q[..., :32], k[..., :32], v[..., :32], block_idx, q_pos, block_size=BS)
    with pytest.raises(ValueError):
        sparse_attention(q, k, v, block_idx, q_pos, block_size=BS, implementation="nope")
    with pytest.raises(ValueError):
        sparse_attention(q, k, v, block_idx, q_pos, block_size=BS, config=SparseAttentionConfig(block_m=96))


def test_kv_major_deeper_q_ring_short_items():
    # Rows of several tiles (24 queries of one block, tq = 8), items of 2 tiles and a 3-deep ring (the
    # other tests run the default 2): the prologue, wrap-around and items shorter than the ring run.
    cfg = SparseAttentionConfig(q_stages=3, tiles_per_item=2)
    q, k, v, block_idx, q_pos = make_inputs(1, 24, (64,), 2, jnp.bfloat16, seed=5)
    _backend.reset_interpret_state()
    out = sparse_attention(q, k, v, block_idx, q_pos, block_size=BS, config=cfg)
    assert not _backend.interpret_races_found(), "race detector fired"
    ref = sparse_attention(q, k, v, block_idx, q_pos, block_size=BS, implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=TOL["out"],
                               rtol=TOL["out"])
