"""MSA top-k block selection: Mosaic GPU kernel vs ``m3jax.msa.select_blocks`` (interpret mode off-GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m3jax import msa
from m3jax.pallas import _backend
from m3jax.pallas.topk import TopkConfig, select_blocks

CFG = TopkConfig(chunk=8, max_concurrent_steps=2)


def _scores(b, hi, t, s, bs, q_pos, seed=0, ties=False, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed))
    iq = jax.random.normal(k1, (b, t, hi, 16), jnp.float32).astype(dtype)
    ik = jax.random.normal(k2, (b, s, 16), jnp.float32).astype(dtype)
    sc = msa.block_scores(iq, ik, q_pos, bs)
    return jnp.round(sc) if ties else sc


def _check(scores, q_pos, bs, k, **kw):
    got = np.asarray(select_blocks(scores, q_pos, block_size=bs, topk=k, config=CFG, **kw))
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
    b, hi, t, bs, prefix = 2, 3, 45, 16, 480
    q_pos = jnp.stack([prefix + jnp.arange(t), 200 + jnp.arange(t)]).astype(jnp.int32)
    scores = _scores(b, hi, t, prefix + t, bs, q_pos, ties=True, dtype=dtype)
    _check(scores, q_pos, bs, 8)


def test_fewer_blocks_than_topk_local_init():
    b, hi, t, bs = 1, 2, 37, 8
    q_pos = jnp.arange(t, dtype=jnp.int32)[None]
    scores = _scores(b, hi, t, t, bs, q_pos, seed=3)
    _check(scores, q_pos, bs, 8, local_blocks=2, init_blocks=1)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(valid=st.integers(1, 40), prefix_blocks=st.integers(0, 40), seed=st.integers(0, 99))
def test_fuzz(valid, prefix_blocks, seed):
    # Fixed shapes (one compilation); fuzzed lengths through q_pos (padding rows at position 0).
    bs, t, s, k = 16, 40, 40 * 16 + 40, 4
    ar = jnp.arange(t, dtype=jnp.int32)
    q_pos = jnp.where(ar < valid, prefix_blocks * bs + ar, 0)[None]
    scores = _scores(1, 2, t, s, bs, q_pos, seed=seed, ties=seed % 2 == 0)
    _check(scores, q_pos, bs, k)
