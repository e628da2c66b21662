"""MSA top-k block selection: the Mosaic GPU kernels (block-major for prefill, row-split for decode) vs
``m3jax.msa.select_blocks`` (interpret mode off-GPU), and the row-split kernel's CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3jax import msa
from m3jax.pallas import _backend
from m3jax.pallas import topk
from m3jax.pallas.topk import ROWSPLIT_MAX_ROWS, TopkConfig, rowsplit, select_blocks

CFG = TopkConfig(chunk=8, max_concurrent_steps=2)


def _scores(b, hi, t, s, bs, q_pos, seed=0, ties=False, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed))
    iq = jax.random.normal(k1, (b, t, hi, 16), jnp.float32).astype(dtype)
    ik = jax.random.normal(k2, (b, s, 16), jnp.float32).astype(dtype)
    sc = msa.block_scores(iq, ik, q_pos, bs)
    return jnp.round(sc) if ties else sc


def _check(scores, q_pos, bs, k, implementation="pallas_blockmajor", **kw):
    got = np.asarray(select_blocks(scores, q_pos, block_size=bs, topk=k, implementation=implementation, config=CFG,
                                   **kw))
    assert not _backend.interpret_races_found()
    ref = np.asarray(select_blocks(scores, q_pos, block_size=bs, topk=k, implementation="reference", **kw))
    assert got.shape == ref.shape and got.dtype == np.int32
    own = np.broadcast_to((np.asarray(q_pos) // bs)[:, None, :], got.shape[:-1]).reshape(-1)
    for g, r, o in zip(got.reshape(-1, k), ref.reshape(-1, k), own):
        n = int((g >= 0).sum())
        assert (g[:n] >= 0).all() and (g[n:] == -1).all()  # -1 only after the valid entries
        assert len(set(g[:n].tolist())) == n  # no duplicates
        assert o in g[:n]  # own block present
        assert set(g[:n].tolist()) == set(r[r >= 0].tolist())
    np.testing.assert_array_equal(got, ref)  # documented: the kernel emits the reference order


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_chunked_prefill_ties_batch(dtype):
    # block-aligned prefix, 3 heads, batch 2 with different lengths, integer-rounded scores (many ties).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    b, hi, t, bs, prefix = 2, 3, 45, 16, 480
    q_pos = jnp.stack([prefix + jnp.arange(t), 200 + jnp.arange(t)]).astype(jnp.int32)
    scores = _scores(b, hi, t, prefix + t, bs, q_pos, ties=True, dtype=dtype)
    _check(scores, q_pos, bs, 8)


def test_fewer_blocks_than_topk_local_init():
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    b, hi, t, bs = 1, 2, 37, 8
    q_pos = jnp.arange(t, dtype=jnp.int32)[None]
    scores = _scores(b, hi, t, t, bs, q_pos, seed=3)
    _check(scores, q_pos, bs, 8, local_blocks=2, init_blocks=1)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(valid=st.integers(1, 40), prefix_blocks=st.integers(0, 40), seed=st.integers(0, 99))
def test_fuzz(valid, prefix_blocks, seed):
    # Fixed shapes (one compilation); fuzzed lengths through q_pos (padding rows at position 0).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    bs, t, s, k = 16, 40, 40 * 16 + 40, 4
    ar = jnp.arange(t, dtype=jnp.int32)
    q_pos = jnp.where(ar < valid, prefix_blocks * bs + ar, 0)[None]
    scores = _scores(1, 2, t, s, bs, q_pos, seed=seed, ties=seed % 2 == 0)
    _check(scores, q_pos, bs, k)


# Row-split at top-64 runs on the GPU only: its 64-wide bitonic merge takes ~12 min in interpret mode
# (top-8 runs the same code in CI).
@pytest.mark.parametrize("implementation,k", [
    ("pallas_blockmajor", 1), ("pallas_blockmajor", 64), ("pallas_rowsplit", 1), ("pallas_rowsplit", 8),
    pytest.param("pallas_rowsplit", 64, marks=pytest.mark.skipif(jax.default_backend() != "gpu",
                                                                 reason="~12 min in interpret mode")),
])
def test_topk_range_and_interventions(implementation, k):
    # top-k 1 and 64 (the range research uses) with msa_force_in / msa_force_out: blocks 3 and 70 in
    # (70 is after the second row's own block 50: never forced), 5 and 79 out (79 is the first row's
    # own block: kept), one sink.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU; its top-64 row-split case only on a GPU
    # (~12 min interpreted)
    bs, nb = 4, 80
    q_pos = jnp.array([[319, 200]], jnp.int32)
    scores = _scores(1, 2, 2, nb * bs, bs, q_pos, seed=k)
    _check(scores, q_pos, bs, k, implementation=implementation, init_blocks=1, force_in=(3, 70), force_out=(5, 79))


def _tie_scores(b, hi, q, nb, bs, q_pos, seed):
    """fp32 [b, hi, q, nb] integers in [-2, 2] with zeros of both signs (ties everywhere, -0.0 vs +0.0);
    blocks past each query's own block are -inf, as in ``msa.block_scores``."""
    rng = np.random.default_rng(seed)
    s = rng.integers(-2, 3, (b, hi, q, nb)).astype(np.float32)
    s = np.where(s == 0, np.where(rng.random(s.shape) < 0.5, -0.0, 0.0), s).astype(np.float32)
    visible = np.arange(nb) <= (np.asarray(q_pos) // bs)[:, None, :, None]
    zeros = s[visible & (s == 0)]
    assert np.signbit(zeros).any() and not np.signbit(zeros).all()
    return jnp.asarray(np.where(visible, s, -np.inf).astype(np.float32))


@pytest.mark.parametrize("k,local,init,ties", [(6, 2, 1, True), (8, 1, 0, False), (16, 2, 1, True)])
def test_rowsplit_decode_rows(k, local, init, ties):
    # B=2, Hi=2, Q=2: 8 rows, one CTA each. nb=300 (not a multiple of 128, 3 SMEM rows); q_pos 5 sees
    # 2 blocks (< topk: -1 padding, 2 SMEM rows skipped), 517 ends inside the second SMEM row.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    bs, nb = 4, 300
    q_pos = jnp.array([[1198, 1199], [5, 517]], jnp.int32)
    if ties:
        scores = _tie_scores(2, 2, 2, nb, bs, q_pos, seed=k)
    else:
        scores = _scores(2, 2, 2, nb * bs, bs, q_pos, seed=k)
    _check(scores, q_pos, bs, k, implementation="pallas_rowsplit", local_blocks=local, init_blocks=init)


@pytest.mark.parametrize("rows_per_step", [2, 3])
def test_rowsplit_rows_per_step(rows_per_step):
    # The main loop's several SMEM rows per step, then the rows left one at a time: nb=300 (3 SMEM rows);
    # q_pos 1199 sees all 3 rows, 517 sees 2 and 5 sees 1, so both loops run full, partial and empty.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    bs, nb, k = 4, 300, 16
    q_pos = jnp.array([[1198, 1199], [5, 517]], jnp.int32)
    scores = _tie_scores(2, 2, 2, nb, bs, q_pos, seed=rows_per_step)
    got = rowsplit.select_blocks(scores, q_pos, block_size=bs, topk=k, local_blocks=2, init_blocks=1,
                                 rows_per_step=rows_per_step)
    assert not _backend.interpret_races_found()
    ref = select_blocks(scores, q_pos, block_size=bs, topk=k, implementation="reference", local_blocks=2, init_blocks=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("lane_list", [2, 4, 16])
def test_rowsplit_short_lists_fall_back_exactly(lane_list):
    # Each thread i of the row-split kernel first keeps only lane_list entries of its blocks {c * 128 + i};
    # the full lists run when a short list lost a value not below the k-th kept one. Row 0: thread 5's
    # blocks hold 10 of the top 16 (its short list loses some of them); row 1: random scores (the short
    # lists are exact); row 2: a tie with the k-th value lost by a short list; lane_list 16 = topk: the
    # full lists only. The ids equal the reference's in every case.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    bs, nb, k = 4, 1536, 16
    q_pos = jnp.array([[nb * bs - 1, nb * bs - 1, nb * bs - 1]], jnp.int32)
    rng = np.random.default_rng(3)
    s = rng.standard_normal((1, 1, 3, nb)).astype(np.float32)
    s[0, 0, 0, 5 + 128 * np.arange(10)] = 10.0 + np.arange(10)
    s[0, 0, 2, 7 + 128 * np.arange(3)] = 50.0  # three equal values in one thread ...
    s[0, 0, 2, 9 + 100 * np.arange(13)] = 60.0 + np.arange(13)  # ... below 13 larger ones elsewhere
    s = jnp.asarray(s).transpose(0, 2, 1, 3).reshape(1, 3, 1, nb)  # rows as heads, one token
    got = rowsplit.select_blocks(s, q_pos[:, :1], block_size=bs, topk=k, local_blocks=1, lane_list=lane_list)
    assert not _backend.interpret_races_found()
    ref = select_blocks(s, q_pos[:, :1], block_size=bs, topk=k, implementation="reference", local_blocks=1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))

def test_rowsplit_reads_scoring_rows_in_place():
    # select_blocks_rows: rows of a [B, n_rows, nb] buffer (row h * Q + t, spare rows past heads * Q), the
    # blocks after each row's own block holding garbage (huge values, NaN) that must count as -inf, the
    # rows scaled by their factors as they load, only the first num_blocks blocks loaded (nb 384 > 300).
    # The ids equal the reference's on the masked, scaled [B, heads, Q, num_blocks] scores.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    bs, nb, num_blocks, k, heads, q = 4, 384, 300, 16, 2, 2
    q_pos = jnp.array([[1198, 1199], [5, 517]], jnp.int32)
    scores = _tie_scores(2, heads, q, num_blocks, bs, q_pos, seed=5)  # -inf after each row's own block
    unscale = jnp.array([[0.5, 2.0, 1.0, 0.25], [4.0, 1.0, 0.5, 8.0]], jnp.float32)  # [B, heads * Q]
    rng = np.random.default_rng(0)
    junk = np.where(rng.random((2, 8, nb)) < 0.5, np.float32(1e30), np.float32(np.nan))
    rows = np.asarray(junk)
    rows[:, : heads * q, :num_blocks] = np.where(np.isneginf(np.asarray(scores).reshape(2, heads * q, num_blocks)),
                                                 junk[:, : heads * q, :num_blocks],
                                                 np.asarray(scores).reshape(2, heads * q, num_blocks))
    got = rowsplit.select_blocks_rows(jnp.asarray(rows), q_pos, unscale, heads=heads, num_blocks=num_blocks,
                                      block_size=bs, topk=k, local_blocks=2, init_blocks=1, force_out=(2,))
    assert not _backend.interpret_races_found()
    want = select_blocks(scores * unscale.reshape(2, heads, q)[..., None], q_pos, block_size=bs, topk=k,
                         implementation="reference", local_blocks=2, init_blocks=1, force_out=(2,))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

def test_pallas_picks_rowsplit_for_few_rows_that_fit(monkeypatch):
    # Machine: any: the choice between the top-k kernels, both stubbed
    calls = []
    monkeypatch.setattr(topk._rowsplit, "select_blocks", lambda *a, **kw: calls.append("rowsplit"))
    monkeypatch.setattr(topk._kernel, "select_blocks", lambda *a, **kw: calls.append("blockmajor"))
    # B=1, Hi=4: rows = 4 t; the last row of 8,192 blocks at top-64 is too large for one CTA's SMEM.
    for t, nb, k in ((ROWSPLIT_MAX_ROWS // 4, 8, 2), (ROWSPLIT_MAX_ROWS // 4 + 1, 8, 2), (1, 8192, 64)):
        select_blocks(jnp.zeros((1, 4, t, nb)), jnp.zeros((1, t), jnp.int32), block_size=4, topk=k)
    assert calls == ["rowsplit", "blockmajor", "blockmajor"]


@pytest.mark.parametrize("b,nb", [(1, 1024), (8, 8192)])
def test_rowsplit_lowers_for_cuda_at_m3_decode_shapes(b, nb):
    # M3 decode: Hi=4 index heads, Q=1, top-16 of 1,024 (128K tokens) / 8,192 (1M) blocks of 128 ->
    # 4 / 32 rows. Lowered for CUDA on the CPU (Pallas -> Mosaic GPU custom call); nothing compiled.
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    args = (jax.ShapeDtypeStruct((b, 4, 1, nb), jnp.float32), jax.ShapeDtypeStruct((b, 1), jnp.int32))
    f = jax.jit(lambda s, p: rowsplit.select_blocks(s, p, block_size=128, topk=16, interpret=False))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
