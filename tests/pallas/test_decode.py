"""MSA decode kernels (paged index scoring, sparse paged attention) vs their pure-jnp references.

Runs the Mosaic GPU kernels in GPU interpret mode on CPU (race detector on). Shapes are tiny: block
(page) 64 (the kernels' wgmma minimum), head dims 64, a batch of 3 with different lengths (one
shorter than topk * block, one not a multiple of the block), shuffled page tables. Index-key pages
in the query's dtype or in fp8 e4m3 (an fp8 index cache, read by the scoring kernel as stored).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from m3jax import msa
from m3jax.pallas import _backend
from m3jax.pallas import decode as D
from m3jax.pallas.decode.kernel import union_pages
from m3jax.pallas.tolerances import TOL

BS, TOPK, N, KH, H, HX = 64, 3, 4, 2, 64, 64


def make_case(seq_lens, q_len, dtype, seed, spare_pages=2, max_pages=None, bs=BS, ik_dtype=None):
    seq_lens = np.asarray(seq_lens, np.int32)
    b = len(seq_lens)
    max_pages = max_pages or int(-(-seq_lens.max() // bs))
    num_pages = b * max_pages + spare_pages
    rng = np.random.default_rng(seed)  # numpy: no per-shape XLA compiles for the inputs

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)

    q, iq = normal(b, q_len, N, H), normal(b, q_len, KH, HX)
    kp, vp, ikp = normal(num_pages, bs, KH, H), normal(num_pages, bs, KH, H), normal(num_pages, bs, HX)
    ikp = ikp if ik_dtype is None else ikp.astype(ik_dtype)  # normals: far inside e4m3's range
    perm = rng.permutation(num_pages)
    pt = perm[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    return q, iq, kp, vp, ikp, jnp.asarray(pt), jnp.asarray(seq_lens)


# References jitted: one XLA compile per shape instead of one per eager op.
_ref_scores = jax.jit(functools.partial(D.decode_index_scores, block_size=BS, implementation="reference"))
_select = jax.jit(functools.partial(msa.select_blocks, block_size=BS, topk=TOPK))
_ref_attention = jax.jit(functools.partial(D.sparse_decode_attention, block_size=BS, implementation="reference",
                                           return_lse=True))


def check_scores(iq, ikp, pt, sl, splits=None, fp8_mma="bfloat16", fp8_convert="smem"):
    """The kernel's scores against the reference's; returns (reference, kernel) scores."""
    ref = np.asarray(_ref_scores(iq, ikp, pt, sl))
    config = D.DecodeScoreConfig(num_splits=splits, fp8_mma=fp8_mma, fp8_convert=fp8_convert)
    got = np.asarray(D.decode_index_scores(iq, ikp, pt, sl, block_size=BS, config=config))
    assert got.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], **TOL[("index_scores", jnp.dtype(iq.dtype).name)])
    return ref, got


def check_attention(q, kp, vp, pt, bidx, sl, dtype, splits=None):
    ref, ref_lse = _ref_attention(q, kp, vp, pt, bidx, sl)
    got, lse = D.sparse_decode_attention(
        q, kp, vp, pt, bidx, sl, block_size=BS, config=D.SparseDecodeConfig(num_splits=splits), return_lse=True
    )
    assert got.shape == ref.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               **TOL[("decode_attention", jnp.dtype(dtype).name)])
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # rows at position -1
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], **TOL[("lse", jnp.dtype(dtype).name)])


@pytest.fixture(autouse=True)
def _no_races():
    _backend.reset_interpret_state()
    yield
    assert not _backend.interpret_races_found()


FP8 = jnp.float8_e4m3fn


@pytest.mark.parametrize(
    "q_len,dtype,splits,ik_dtype,fp8_convert",
    [(1, jnp.float32, 2, None, "smem"), (4, jnp.bfloat16, 1, None, "smem"), (4, jnp.float32, None, None, "smem"),
     (4, jnp.bfloat16, 2, FP8, "smem"), (1, jnp.float32, None, FP8, "smem"),
     (4, jnp.bfloat16, 2, FP8, "registers"), (1, jnp.float32, None, FP8, "registers")],
)
def test_decode_step(q_len, dtype, splits, ik_dtype, fp8_convert):
    # Q=1: 100 < topk * BS (fewer visible blocks than top-k); 150 not a multiple of BS; 256 = 4 blocks.
    # Q=4: the first request has seq_len 3 < Q, so its first query row has position -1 (-> 0 output).
    # fp8 pages: the bf16 query meets the converted keys in one MMA, an fp32 one as three bf16 pieces;
    # the keys converted in SMEM or (fp8_convert="registers", the GPU's wgmma; interpret mode runs the
    # SMEM path) in registers as the wgmma's A operand: the same scores and selections.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    lens = [100, 150, 256] if q_len == 1 else [3, 150, 256]
    q, iq, kp, vp, ikp, pt, sl = make_case(lens, q_len, dtype, seed=q_len, ik_dtype=ik_dtype)
    scores, got = check_scores(iq, ikp, pt, sl, splits=splits, fp8_convert=fp8_convert)
    q_pos = D.query_positions(sl, q_len)
    bidx = np.asarray(_select(jnp.asarray(scores), q_pos))
    # the kernel's scores select the reference's blocks (as sets)
    np.testing.assert_array_equal(np.sort(np.asarray(_select(jnp.asarray(got), q_pos)), -1), np.sort(bidx, -1))
    # selections are unordered in the contract: shuffle the valid prefix of every row.
    perm = np.random.default_rng(7).permutation(TOPK)
    shuffled = jnp.asarray(np.where((bidx >= 0).all(-1, keepdims=True), bidx[..., perm], bidx))
    check_attention(q, kp, vp, pt, shuffled, sl, dtype, splits=splits)


def test_attention_sub_page_tiles():
    # pages of 128 keys loaded as two 64-key pipeline steps (the fp32 / block-256 SMEM fallback).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    bs, topk = 128, 2
    q, _, kp, vp, _, pt, sl = make_case([200, 300], 2, jnp.float32, seed=3, bs=bs)
    q_pos = D.query_positions(sl, 2)
    bidx = jnp.stack([jnp.stack([q_pos // bs, jnp.maximum(q_pos // bs - 1, 0)], -1)] * KH, 1)  # [B, K, Q, 2]
    bidx = jnp.where((jnp.arange(topk) == 1) & (q_pos < bs)[:, None, :, None], -1, bidx)
    ref = D.sparse_decode_attention(q, kp, vp, pt, bidx, sl, block_size=bs, implementation="reference")
    got = D.sparse_decode_attention(
        q, kp, vp, pt, bidx, sl, block_size=bs, config=D.SparseDecodeConfig(num_splits=1, kv_tile=64)
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), **TOL[("decode_attention", "float32")])


@pytest.mark.parametrize("fp8_convert", ["smem", "registers"])
def test_index_scores_fp8_pages_in_f16(fp8_convert):
    # DecodeScoreConfig(fp8_mma="float16"): keys e4m3 -> f16, bf16 queries scaled per row into f16's
    # range; rows of 2^20 and 2^-20 scale (beyond f16's max, inside its subnormals) score as the rest.
    # The keys converted in SMEM or in registers (the GPU; interpret mode runs the SMEM path).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    _, iq, _, _, ikp, pt, sl = make_case([3, 150, 256], 4, jnp.bfloat16, seed=5, ik_dtype=FP8)
    iq = iq.at[1, :, 0].multiply(2.0**20).at[2, :, 1].multiply(2.0**-20)
    check_scores(iq, ikp, pt, sl, splits=2, fp8_mma="float16", fp8_convert=fp8_convert)


@settings(max_examples=3, deadline=None)
@given(lens=st.lists(st.integers(1, 256), min_size=2, max_size=2), seed=st.integers(0, 2**16))
def test_index_scores_fuzz_lengths(lens, seed):
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    _backend.reset_interpret_state()
    # fixed max_pages (256 / BS): every example has the same shapes, so the kernel compiles once.
    _, iq, _, _, ikp, pt, sl = make_case(lens, 2, jnp.float32, seed=seed, max_pages=256 // BS)
    check_scores(iq, ikp, pt, sl, splits=2)
    assert not _backend.interpret_races_found()


def test_union_pages():
    # Machine: any: a jnp helper, jitted on the default backend
    bidx = jnp.array([[[[5, 2, -1], [2, 7, 5]]]], jnp.int32)  # B=1, K=1, Q=2
    logical, bits, count = jax.jit(union_pages)(bidx)
    assert int(count[0, 0]) == 3
    np.testing.assert_array_equal(np.asarray(logical[0, 0, :3]), [5, 2, 7])
    np.testing.assert_array_equal(np.asarray(bits[0, 0, :3]), [3, 3, 2])
    assert (np.asarray(logical[0, 0, 3:]) == -1).all() and (np.asarray(bits[0, 0, 3:]) == 0).all()
    logical, bits, count = jax.jit(union_pages)(jnp.array([[[[4, -1], [-1, 4]]]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(logical[0, 0]), [4, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(bits[0, 0]), [3, 0, 0, 0])
    assert int(count[0, 0]) == 1


@pytest.mark.parametrize(
    "q_len,dtype,ik_dtype,score_dtype,fp8_mma,splits",
    [(1, jnp.bfloat16, None, "bfloat16", "bfloat16", None), (4, jnp.float32, None, "bfloat16", "bfloat16", 2),
     (4, jnp.bfloat16, FP8, "bfloat16", "float16", 3), (2, jnp.bfloat16, FP8, "float8_e4m3fn", "bfloat16", None)],
)
def test_score_select_reads_the_kernel_rows(q_len, dtype, ik_dtype, score_dtype, fp8_mma, splits):
    # decode_score_select: the row-split top-k reads the scoring kernel's rows in place (blocks past a
    # request's live pages never written, the rows' factors of the f16 MMA and of the fp8 indexer applied
    # as the rows load). Its ids must be the reference selection's on the kernel's own scores, in order,
    # with the forced blocks (two local blocks, a sink, an intervention in and one out) and Q tokens a
    # request; request 0 has 2 of the 5 pages live, so 3 pages of its rows are never written.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    lens = [100, 150, 300] if q_len == 1 else [q_len + 97, 150, 300]
    _, iq, _, _, ikp, pt, sl = make_case(lens, q_len, dtype, seed=11 + q_len, ik_dtype=ik_dtype)
    config = D.DecodeScoreConfig(num_splits=splits, fp8_mma=fp8_mma)
    kw = dict(block_size=BS, topk=TOPK + 1, local_blocks=2, init_blocks=1, force_in=(3,), force_out=(1,))
    scores = D.decode_index_scores(iq, ikp, pt, sl, block_size=BS, config=config, score_dtype=score_dtype)
    q_pos = D.query_positions(sl, q_len)
    want = np.asarray(msa.select_blocks(scores, q_pos, **kw))
    got = D.decode_score_select(iq, ikp, pt, sl, q_pos, config=config, score_dtype=score_dtype, **kw)
    np.testing.assert_array_equal(np.asarray(got), want)
    # and with the positions derived from the lengths
    np.testing.assert_array_equal(np.asarray(D.decode_score_select(iq, ikp, pt, sl, config=config,
                                                                    score_dtype=score_dtype, **kw)), want)


def test_score_rows_past_one_tma_box():
    # One split over 297 pages: the scoring kernel's transposed tile goes out in TMA boxes of at most
    # 256 pages (256 + 44 of the chunk's 300), read in place by the top-k.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    _, iq, _, _, ikp, pt, sl = make_case([297 * BS - 5, 150], 1, jnp.bfloat16, seed=21)
    config = D.DecodeScoreConfig(num_splits=1)
    _, got = check_scores(iq, ikp, pt, sl, splits=1)
    kw = dict(block_size=BS, topk=TOPK)
    q_pos = D.query_positions(sl, 1)
    want = np.asarray(msa.select_blocks(jnp.asarray(got), q_pos, **kw))
    np.testing.assert_array_equal(np.asarray(D.decode_score_select(iq, ikp, pt, sl, q_pos, config=config, **kw)), want)
