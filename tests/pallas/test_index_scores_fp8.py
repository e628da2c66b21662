"""The fp8 indexer (``score_dtype="float8_e4m3fn"``) through the prefill index-score kernel (e4m3 x e4m3
MMA, fp32 sums, row and key scales in the epilogue) against the jnp reference on the same quantised
operands (:func:`m3jax.msa.reference.fp8_index_operands`), with and without fp8 index-cache keys.

Scores within ``TOL[("index_scores", "float8_e4m3fn")]`` (a bound relative to the block's score scale:
:mod:`m3jax.pallas.tolerances`); selections (scores + top-k kernel, and the fused top-k) equal to the
top-k of the kernel's own scores exactly, and to the reference's except rows whose reference margin
is a near-tie under twice that bound (:mod:`m3jax.msa.compare`). The paged decode scoring kernel's
fp8 path (fp8 index pages multiplied as loaded) likewise against the reference over the gathered
pages. Off-GPU the kernels run in Mosaic GPU interpret mode with the race detector on; tests taking
``target`` run as built for the device and as built for Blackwell (tcgen05), as
tests/pallas/test_index_scores.py does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import msa
from m3jax.msa import compare
from m3jax.msa.reference import fp8_index_operands
from m3jax.pallas import _backend
from m3jax.pallas.index_scores import IndexScoreConfig, index_block_scores, index_select_blocks
from m3jax.pallas.tolerances import TOL
from tests.pallas.test_index_scores import target  # noqa: F401  (the fixture)

FP8 = "float8_e4m3fn"
HX, BS = 64, 16
CFG = IndexScoreConfig(rows=64, group=2, max_concurrent_steps=2)
CFG_FUSED = IndexScoreConfig(rows=64, group=2, max_concurrent_steps=2, fused_topk=True)


def _case(keys_fp8, seed):
    # chunked prefill: a block-aligned prefix, a batch of 2 with a shorter second sequence, 4 index
    # heads, S not a block multiple; keys of another spread than the queries (scales differ per key)
    b, t, hi, prefix = 2, 21, 4, 48
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    iq = jax.random.normal(k1, (b, t, hi, HX), jnp.float32).astype(jnp.bfloat16)
    spread = jnp.exp(jax.random.normal(k3, (b, prefix + t, 1)))
    ik = (jax.random.normal(k2, (b, prefix + t, HX)) * spread).astype(jnp.bfloat16)
    if keys_fp8:  # an fp8 index cache's keys: e4m3 values, here as the bf16 the kernels path passes
        ik = ik.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16)
    q_pos = jnp.stack([prefix + jnp.arange(t), jnp.maximum(prefix - 32 + jnp.arange(t), 0)]).astype(jnp.int32)
    return iq, ik, q_pos


def _score_scale(iq, ik, q_pos, keys_fp8):
    """S per (b, head, query, block): the block's largest sum_i |qv_i kv_i| qs ks (the bound's scale)."""
    qv, qs, kv, ks = fp8_index_operands(iq, ik, keys_fp8)
    a = jnp.einsum("bchx,bsx->bhcs", jnp.abs(qv.astype(jnp.float32)), jnp.abs(kv.astype(jnp.float32)),
                   precision=jax.lax.Precision.HIGHEST) * jnp.moveaxis(qs, 2, 1) * ks[:, None, None, :, 0]
    nb = -(-ik.shape[1] // BS)
    a = jnp.pad(a, [(0, 0)] * 3 + [(0, nb * BS - ik.shape[1])])
    return np.asarray(a.reshape(*a.shape[:3], nb, BS).max(-1))


@pytest.mark.parametrize("keys_fp8", [False, True])
def test_fp8_scores_and_selections(keys_fp8, target):  # noqa: F811
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    iq, ik, q_pos = _case(keys_fp8, seed=int(keys_fp8))
    kw = dict(block_size=BS, score_dtype=FP8, keys_fp8=keys_fp8)
    got = np.asarray(index_block_scores(iq, ik, q_pos, config=CFG, **kw))
    ref = np.asarray(index_block_scores(iq, ik, q_pos, implementation="reference", **kw))
    assert not _backend.interpret_races_found()
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    bound = HX * TOL[("index_scores", FP8)] * _score_scale(iq, ik, q_pos, keys_fp8)
    assert (np.abs(got[fin] - ref[fin]) <= bound[fin]).all(), np.abs(got[fin] - ref[fin]).max()
    bf16 = np.asarray(index_block_scores(iq, ik, q_pos, implementation="reference", block_size=BS))
    assert not np.allclose(got[fin], bf16[fin], rtol=1e-3)  # the e4m3 operands, not a bf16 product

    sel = dict(topk=4, local_blocks=2, init_blocks=1, force_in=(1,), force_out=(2,))
    own = msa.select_blocks(jnp.asarray(got), q_pos, block_size=BS, **sel)  # top-k of the kernel's scores
    ref_sel = index_select_blocks(iq, ik, q_pos, implementation="reference", **kw, **sel)
    scale = np.max(np.where(fin, _score_scale(iq, ik, q_pos, keys_fp8), 0.0), axis=-1)
    for config in (CFG, CFG_FUSED):
        ids = index_select_blocks(iq, ik, q_pos, config=config, **kw, **sel)
        assert not _backend.interpret_races_found()
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(own))
        diff = compare.compare_selections(ids, ref_sel, ref, q_pos, BS, scale, 2 * HX * TOL[("index_scores", FP8)])
        assert diff.unexplained == 0, diff


def test_fp8_refusals():
    # Machine: any: argument checks before any kernel runs
    from m3jax.pallas import decode as D

    iq, ik, q_pos = _case(False, seed=0)
    with pytest.raises(ValueError, match=r"index_block_scores: score_dtype='float16'; choose one of"):
        index_block_scores(iq, ik, q_pos, block_size=BS, score_dtype="float16")
    with pytest.raises(ValueError, match=r"index_select_blocks: index_head_dim 16 must be a multiple of 32"):
        index_select_blocks(iq[..., :16], ik[..., :16], q_pos, block_size=BS, topk=2, score_dtype=FP8)
    iq, pages, pt, sl = _paged_case([100], 1, seed=0)
    with pytest.raises(ValueError, match="reads fp8 index pages as stored"):  # bf16 pages: not in place
        D.decode_index_scores(iq, pages.astype(jnp.bfloat16), pt, sl, block_size=64, score_dtype=FP8)
    with _backend.interpret_as(_backend.BLACKWELL), pytest.raises(ValueError, match="tcgen05 decode scoring"):
        D.decode_index_scores(iq, pages, pt, sl, block_size=64, score_dtype=FP8)


def _paged_case(seq_lens, q_len, seed, hi=2, hx=64, bs=64):
    seq_lens = np.asarray(seq_lens, np.int32)
    b = len(seq_lens)
    max_pages = int(-(-seq_lens.max() // bs)) + 1  # one page past the longest: never visited
    num_pages = b * max_pages + 2
    rng = np.random.default_rng(seed)
    iq = jnp.asarray(rng.standard_normal((b, q_len, hi, hx)), jnp.bfloat16)
    spread = np.exp(rng.standard_normal((num_pages, bs, 1)))  # per-key magnitudes inside e4m3's range
    pages = jnp.asarray(rng.standard_normal((num_pages, bs, hx)) * spread).astype(jnp.float8_e4m3fn)
    pt = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    return iq, pages, jnp.asarray(pt), jnp.asarray(seq_lens)


@pytest.mark.parametrize("lens,q_len", [([100, 300], 1), ([1, 200, 130], 2)])  # 2: a row at position -1
def test_fp8_decode_scores(lens, q_len):
    # The paged decode scoring kernel under the fp8 indexer: fp8 pages multiplied as loaded (e4m3 x
    # e4m3 wgmma), the query rows' scales after the block max; against the reference over the gathered
    # pages (keys as stored), and the top-k of its scores against the reference's (near-ties counted).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.pallas import decode as D

    _backend.reset_interpret_state()
    iq, pages, pt, sl = _paged_case(lens, q_len, seed=q_len)
    bs, hx = pages.shape[1], pages.shape[2]
    got = np.asarray(D.decode_index_scores(iq, pages, pt, sl, block_size=bs, score_dtype=FP8))
    ref = np.asarray(D.decode_index_scores(iq, pages, pt, sl, block_size=bs, score_dtype=FP8,
                                           implementation="reference"))
    assert not _backend.interpret_races_found()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    q_pos = D.query_positions(sl, q_len)
    ik = D.reference.gather_pages(pages, pt).astype(jnp.bfloat16)  # e4m3 values, exact in bf16
    nb = pt.shape[1]
    qv, qs, kv, ks = fp8_index_operands(iq, ik, keys_fp8=True)
    a = jnp.einsum("bchx,bsx->bhcs", jnp.abs(qv.astype(jnp.float32)), jnp.abs(kv.astype(jnp.float32)),
                   precision=jax.lax.Precision.HIGHEST) * jnp.moveaxis(qs, 2, 1)
    scale = np.asarray(a.reshape(*a.shape[:3], nb, bs).max(-1))
    bound = hx * TOL[("index_scores", FP8)] * scale
    assert (np.abs(got[fin] - ref[fin]) <= bound[fin]).all(), np.abs(got[fin] - ref[fin]).max()
    sel = dict(block_size=bs, topk=3, local_blocks=1, init_blocks=1)
    ids = msa.select_blocks(jnp.asarray(got), q_pos, **sel)
    ref_ids = msa.select_blocks(jnp.asarray(ref), q_pos, **sel)
    row_scale = np.max(np.where(fin, scale, 0.0), axis=-1)
    diff = compare.compare_selections(ids, ref_ids, ref, q_pos, bs, row_scale, 2 * hx * TOL[("index_scores", FP8)])
    assert diff.unexplained == 0, diff
