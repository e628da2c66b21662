"""MSA index block scores (+ fused top-k): Mosaic GPU kernel vs the pure-jnp reference.

Off-GPU the kernels run in Mosaic GPU interpret mode with the race detector on (``mosaic_kernel``).
Shapes are tiny (head dim 64, block 16/32) to keep the file fast on a CPU. Tests taking the ``target``
fixture run twice: as built for the device (Hopper wgmma off-GPU) and as built for Blackwell
(tcgen05 into TMEM, m3jax/pallas/index_scores/blackwell.py) in interpret mode, which models tcgen05
and TMEM but not their shape and layout rules (test_lowering.py lowers the variant for sm_100a).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3jax.pallas import _backend
from m3jax.pallas.index_scores import IndexScoreConfig, index_block_scores, index_select_blocks
from m3jax.pallas.tolerances import TOL
CFG = IndexScoreConfig(rows=64, group=2, max_concurrent_steps=2, fused_topk=True)
CFG_UNFUSED = IndexScoreConfig(rows=64, group=2, max_concurrent_steps=2)


@pytest.fixture(params=["device", "blackwell"])
def target(request, monkeypatch):
    if request.param == "device":
        yield
        return
    from m3jax.pallas.index_scores import blackwell

    calls = []
    row_max = blackwell.row_max
    monkeypatch.setattr(blackwell, "row_max", lambda *a: calls.append(1) or row_max(*a))
    _backend.reset_interpret_state()
    with _backend.interpret_as(_backend.BLACKWELL):
        yield
    assert calls, "the Blackwell kernel did not run"


def _inputs(b, t, hi, hx, s, dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    iq = jax.random.normal(k1, (b, t, hi, hx), jnp.float32).astype(dtype)
    ik = jax.random.normal(k2, (b, s, hx), jnp.float32).astype(dtype)
    return iq, ik


def _run_scores(iq, ik, q_pos, bs, cfg=CFG):
    got = index_block_scores(iq, ik, q_pos, block_size=bs, config=cfg)
    ref = index_block_scores(iq, ik, q_pos, block_size=bs, implementation="reference")
    assert not _backend.interpret_races_found()
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    np.testing.assert_allclose(got, ref, **TOL[("index_scores", jnp.dtype(iq.dtype).name)])
    return ref


def _check_topk(got, ref, q_pos, bs):
    """Sets equal to the reference; -1 only after valid entries; no duplicates; own block present."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape
    own = np.asarray(q_pos)[:, None, :] // bs
    for row_g, row_r, o in zip(got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1]),
                               np.broadcast_to(own, got.shape[:-1]).reshape(-1)):
        valid = row_g[row_g >= 0]
        n = len(valid)
        assert (row_g[:n] >= 0).all() and (row_g[n:] == -1).all()
        assert len(set(valid.tolist())) == n
        assert o in valid
        assert set(valid.tolist()) == set(row_r[row_r >= 0].tolist())
    # The kernel emits the reference order exactly.
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_chunked_prefill_batch_heads(dtype, target):
    # chunked prefill: block-aligned prefix, T not a multiple of the block, batch of 2 with a shorter
    # second sequence, 4 index heads; the msa_force_in / msa_force_out interventions (block 1 forced
    # in, block 2 out; block 4 out is the own block of the first sequence's later queries: kept).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    b, t, hi, hx, bs, prefix = 2, 21, 4, 64, 16, 48
    s = prefix + t
    iq, ik = _inputs(b, t, hi, hx, s, dtype)
    q_pos = jnp.stack([prefix + jnp.arange(t), jnp.maximum(prefix - 32 + jnp.arange(t), 0)]).astype(jnp.int32)
    ref = _run_scores(iq, ik, q_pos, bs)
    force = dict(force_in=(1,), force_out=(2, 4))
    got = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=3, config=CFG, **force)
    assert not _backend.interpret_races_found()
    from m3jax import msa

    _check_topk(got, msa.select_blocks(jnp.asarray(ref), q_pos, block_size=bs, topk=3, **force), q_pos, bs)


def test_prefill_from_zero_fewer_blocks_than_topk_local_init(target):
    # prefill from position 0: fewer visible blocks than top-k (-1 padding), ragged S (not a block
    # multiple), local_blocks=2 + one sink, block 32.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    b, t, hi, hx, bs = 1, 50, 2, 64, 32
    iq, ik = _inputs(b, t, hi, hx, t, jnp.bfloat16, seed=1)
    q_pos = jnp.arange(t, dtype=jnp.int32)[None]
    _run_scores(iq, ik, q_pos, bs)
    got = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=4, local_blocks=2, init_blocks=1,
                              config=CFG_UNFUSED)
    ref = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=4, local_blocks=2, init_blocks=1,
                              implementation="reference")
    assert not _backend.interpret_races_found()
    _check_topk(got, ref, q_pos, bs)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(prefix_blocks=st.integers(0, 4), valid=st.integers(1, 24), seed=st.integers(0, 100))
def test_fuzz_lengths(prefix_blocks, valid, seed):
    # Fixed array shapes (one compilation); the fuzzed lengths live in q_pos: a block-aligned prefix
    # and `valid` real queries, the rest padding rows at position 0 (as map_query_chunks pads).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    bs, hi, t, s = 16, 2, 24, 88
    prefix = prefix_blocks * bs
    iq, ik = _inputs(1, t, hi, 64, s, jnp.float32, seed=seed)
    ar = jnp.arange(t, dtype=jnp.int32)
    q_pos = jnp.where(ar < valid, prefix + ar, 0)[None]
    _run_scores(iq, ik, q_pos, bs)
    got = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=2, config=CFG)
    ref = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=2, implementation="reference")
    assert not _backend.interpret_races_found()
    _check_topk(got, ref, q_pos, bs)
