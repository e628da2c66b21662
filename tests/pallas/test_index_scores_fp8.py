"""The fp8 indexer (``score_dtype="float8_e4m3fn"``) through the prefill index-score kernel (e4m3 x e4m3
MMA, fp32 sums, row and key scales in the epilogue) against the jnp reference on the same quantised
operands (:func:`m3jax.msa.reference.fp8_index_operands`), with and without fp8 index-cache keys.

Scores within ``TOL[("index_scores", "float8_e4m3fn")]`` (a bound relative to the block's score scale:
:mod:`m3jax.pallas.tolerances`); selections (scores + top-k kernel, and the fused top-k) equal to the
top-k of the kernel's own scores exactly, and to the reference's except rows whose reference margin
is a near-tie under twice that bound (:mod:`m3jax.msa.compare`). Off-GPU the kernels run in Mosaic GPU
interpret mode with the race detector on; tests taking ``target`` run as built for the device and as
built for Blackwell (tcgen05), as tests/pallas/test_index_scores.py does.
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
    iq, ik, q_pos = _case(False, seed=0)
    with pytest.raises(ValueError, match=r"index_block_scores: score_dtype='float16'; choose one of"):
        index_block_scores(iq, ik, q_pos, block_size=BS, score_dtype="float16")
    with pytest.raises(ValueError, match=r"index_select_blocks: index_head_dim 16 must be a multiple of 32"):
        index_select_blocks(iq[..., :16], ik[..., :16], q_pos, block_size=BS, topk=2, score_dtype=FP8)
