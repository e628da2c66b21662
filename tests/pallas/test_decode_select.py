"""The fused paged decode selection (index scores, block max and per-split top-k in one launch, the
splits' lists merged) against its pure-jnp reference.

Runs the Mosaic GPU kernel in GPU interpret mode on CPU (race detector on), compiled for the device on
a GPU: the same assertions on both. Block (page) 64 (the scoring kernel's wgmma M minimum), Hx 64,
two index heads, ragged lengths over shuffled page tables, forced local / sink blocks and the
``force_in`` / ``force_out`` interventions, context splits of one page (lists shorter than top-k) up
to the whole context. Small-integer inputs make every score exact whatever the summation order, with
many exact ties: the ids must then equal the reference's in order (the tie order included). Normal
inputs: equal to the reference except rows whose reference margin is a near-tie
(:mod:`m3jax.msa.compare`), and in order equal to the top-k of the scoring kernel's own scores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import msa
from m3jax.msa import compare
from m3jax.pallas import _backend
from m3jax.pallas import decode as D

BS, HI, HX = 64, 2, 64
FP8 = jnp.float8_e4m3fn
SEL = dict(block_size=BS, topk=5, local_blocks=2, init_blocks=1, force_in=(3,), force_out=(1, 6))


def make_case(seq_lens, q_len, dtype, ik_dtype, ints, seed):
    seq_lens = np.asarray(seq_lens, np.int32)
    b = len(seq_lens)
    max_pages = int(-(-seq_lens.max() // BS)) + 1  # one page past the longest: never visited
    num_pages = b * max_pages + 2
    rng = np.random.default_rng(seed)

    def draw(*shape):
        x = rng.integers(-1, 2, shape).astype(np.float32) if ints else rng.standard_normal(shape, np.float32)
        return jnp.asarray(x).astype(dtype)

    iq, ikp = draw(b, q_len, HI, HX), draw(num_pages, BS, HX)
    ikp = ikp if ik_dtype is None else ikp.astype(ik_dtype)  # small integers and normals: inside e4m3's range
    pt = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    return iq, ikp, jnp.asarray(pt), jnp.asarray(seq_lens)


_reference = jax.jit(functools.partial(D.decode_select_blocks, implementation="reference", **SEL))
_ref_scores = jax.jit(functools.partial(D.decode_index_scores, block_size=BS, implementation="reference"))
_select = jax.jit(functools.partial(msa.select_blocks, **SEL))


@pytest.fixture(autouse=True)
def _no_races():
    _backend.reset_interpret_state()
    yield
    assert not _backend.interpret_races_found()


# fp8 pages: fp8_convert "registers" feeds the converted keys to the wgmma from registers (the GPU; interpret
# mode runs the SMEM path)
@pytest.mark.parametrize(
    "lens,q_len,dtype,ik_dtype,splits,fp8_mma,ints,fp8_convert",
    [
        ([700], 1, jnp.bfloat16, None, 1, "bfloat16", True, "smem"),  # B=1, the whole context in one CTA
        ([100, 700], 1, jnp.bfloat16, FP8, 12, "bfloat16", True, "smem"),  # one page per split: lists of 1
        ([1, 300, 700], 2, jnp.bfloat16, FP8, 3, "float16", True, "smem"),  # fp8 in f16; a row at position -1
        ([130, 700, 450], 1, jnp.float32, None, 2, "bfloat16", True, "smem"),  # fp32: three bf16 pieces
        ([260, 700], 2, jnp.bfloat16, None, 4, "bfloat16", False, "smem"),
        ([700, 333], 1, jnp.bfloat16, FP8, None, "bfloat16", False, "smem"),  # default splits
        ([60, 100], 1, jnp.bfloat16, None, None, "bfloat16", True, "smem"),  # fewer candidates than top-k
        ([100, 700], 1, jnp.bfloat16, FP8, 12, "bfloat16", True, "registers"),
        ([1, 300, 700], 2, jnp.bfloat16, FP8, 3, "float16", True, "registers"),
    ],
)
def test_decode_select_blocks(lens, q_len, dtype, ik_dtype, splits, fp8_mma, ints, fp8_convert):
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    iq, ikp, pt, sl = make_case(lens, q_len, dtype, ik_dtype, ints, seed=len(lens) * 10 + q_len)
    config = D.DecodeScoreConfig(num_splits=splits, fp8_mma=fp8_mma, fp8_convert=fp8_convert)
    got = np.asarray(D.decode_select_blocks(iq, ikp, pt, sl, config=config, **SEL))
    ref = np.asarray(_reference(iq, ikp, pt, sl))
    assert got.shape == ref.shape == (len(lens), HI, q_len, SEL["topk"]) and got.dtype == np.int32
    if ints:
        np.testing.assert_array_equal(got, ref)  # exact scores: the same ids in the same order
        return
    # The kernel's selection is the reference selection of the scoring kernel's scores (same MMAs).
    q_pos = D.query_positions(sl, q_len)
    scores = D.decode_index_scores(iq, ikp, pt, sl, block_size=BS, config=config)
    np.testing.assert_array_equal(got, np.asarray(_select(scores, q_pos)))
    ref_scores = _ref_scores(iq, ikp, pt, sl)
    scale = jnp.max(jnp.where(jnp.isfinite(ref_scores), jnp.abs(ref_scores), 0.0), axis=-1)
    diff = compare.compare_selections(got, ref, ref_scores, q_pos, BS, scale, compare.summation_bound(HX))
    assert diff.unexplained == 0, diff


def test_model_decode_switch():
    # TextConfig.msa_decode_select="fused" reaches the model's in-place decode: the same block ids and
    # output as the scoring + top-k kernels.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    import m3jax
    from m3jax.cache import LayerCache
    from m3jax.msa import kernels

    t = m3jax.preset("m3_width").replace_text(
        num_attention_heads=4, num_key_value_heads=HI, head_dim=64, index_n_heads=HI, index_head_dim=HX,
        index_block_size=BS, index_topk_blocks=3, index_init_blocks=1).text
    iq, ikp, pt, sl = make_case([450], 1, jnp.bfloat16, FP8, ints=False, seed=3)
    rng = np.random.default_rng(4)
    k, v, q = (jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
               for s in ((ikp.shape[0], BS, HI, 64), (ikp.shape[0], BS, HI, 64), (1, 1, 4, 64)))
    pos = sl[:, None] - 1
    run = {mode: kernels.decode(q, iq, LayerCache(k, v, ikp), pt, pos, dataclasses.replace(t, msa_decode_select=mode))
           for mode in ("separate", "fused")}
    np.testing.assert_array_equal(np.asarray(run["fused"][1]), np.asarray(run["separate"][1]))
    np.testing.assert_array_equal(np.asarray(run["fused"][0], np.float32), np.asarray(run["separate"][0], np.float32))
    with pytest.raises(ValueError, match="msa_decode_select"):
        dataclasses.replace(t, msa_decode_select="one_launch")
