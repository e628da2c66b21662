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
Threshold insertion (a page's row is inserted only where it beats a row's k-th kept value or may be
forced): splits of up to 40 pages with block maxima in increasing, decreasing, tied and periodic
order, and the scalar forced-page test against the reference's priorities.
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


def ramp_case(seq_lens, pattern, seed):
    """Block maxima in a chosen order (exact small integers, bf16 pages): every key of page j carries
    v_j in dim 0; query head 0 is +e_0 and head 1 is -e_0, so head 0 ranks the pages by v and head 1
    by -v. "ramp": v_j = j (head 0 increasing, every page beats the k-th; head 1 decreasing, none
    after the first k). "tied": one value everywhere (no page displaces an equal earlier one).
    "mod": v_j = 3 j mod 7 (many ties at every rank)."""
    iq, ikp, pt, sl = make_case(seq_lens, 2, jnp.bfloat16, None, True, seed)
    pages = np.asarray(pt)
    v = {"ramp": lambda j: j, "tied": lambda j: 0 * j + 2, "mod": lambda j: (3 * j) % 7}[pattern]
    keys = np.zeros(ikp.shape, np.float32)
    for b in range(pages.shape[0]):
        keys[pages[b], :, 0] = v(np.arange(pages.shape[1]))[:, None]
    q = np.zeros(iq.shape, np.float32)
    q[:, :, 0, 0], q[:, :, 1, 0] = 1.0, -1.0
    return jnp.asarray(q, jnp.bfloat16), jnp.asarray(keys, jnp.bfloat16), pt, sl


@pytest.mark.parametrize("pattern,splits", [("ramp", 1), ("tied", 2), ("mod", 3)])
def test_decode_select_threshold(pattern, splits):
    # Many pages per context split (up to 40 at top-5): after the first k pages a page's row is inserted
    # only where it beats a row's k-th kept value or a forced priority applies (own, local, sink,
    # force_in, force_out blocks of SEL), the rest skip the insertion. The ids equal the reference's,
    # in order, ties included.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    iq, ikp, pt, sl = ramp_case([2560, 1900], pattern, seed=5)
    config = D.DecodeScoreConfig(num_splits=splits)
    got = np.asarray(D.decode_select_blocks(iq, ikp, pt, sl, config=config, **SEL))
    np.testing.assert_array_equal(got, np.asarray(_reference(iq, ikp, pt, sl)))


@pytest.mark.parametrize("local_blocks,init_blocks,force_in", [(1, 0, ()), (2, 1, (3,)), (3, 2, (0, 5, 9)),
                                                              (0, 1, (4,))])
def test_may_force(local_blocks, init_blocks, force_in):
    # The fused selection's scalar test of whether a page can carry a forced priority in some query row:
    # never no where the reference forces (the page would skip its insertion), and exact when
    # local_blocks >= 1 (with none it also says yes for blocks up to the last row's own block).
    # Machine: any: pure jnp
    from m3jax.msa.reference import forced_priority
    from m3jax.pallas.topk import select

    bs, j = 4, jnp.arange(12)[:, None, None]
    lo = jnp.arange(-1, 40)[None, :, None]
    hi = lo + jnp.arange(0, 9)[None, None, :]  # rows at positions lo .. hi (Q = hi - lo + 1)
    kw = dict(local_blocks=local_blocks, init_blocks=init_blocks, force_in=force_in)
    pos = lo[..., None] + jnp.arange(9)  # [.., Q]: only positions <= hi are rows
    prio = forced_priority(jnp.floor_divide(pos, bs) - j[..., None], j[..., None], **kw)
    want = jnp.any((prio > 0) & (pos <= hi[..., None]), axis=-1)
    got = select.may_force(j, lo, hi, block_size=bs, **kw)
    assert not np.any(np.asarray(want & ~got))
    if local_blocks:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


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
