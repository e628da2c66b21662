"""``index_score_dtype="float8_e4m3fn"`` (the fp8 indexer): the jnp reference's quantisation against
an independent numpy one, the bf16 default untouched, selections against bf16's with the differing
rows explained as near-ties, the setting's validation, its refusal on the kernels path, and the
needle / generate ``--config-override`` that turns it on."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import m3jax
from m3jax.cache import cached_block_scores
from m3jax.config import UnsupportedConfigError
from m3jax.msa import compare, layer as msa_layer, reference
from tests.conftest import tiny_config

FP8_NAME = "float8_e4m3fn"


def _numpy_fp8_block_scores(iq, ik, q_pos, block_size, keys_fp8=False):
    """The fp8 indexer in numpy (ml_dtypes' e4m3 cast, float64 sums): per-row amax / 448 scales."""
    e4m3 = ml_dtypes.float8_e4m3fn

    def quantize(x):
        x = x.astype(np.float32)
        scale = (np.abs(x).max(-1, keepdims=True) / np.float32(448.0)).astype(np.float32)
        scale = np.where(scale > 0, scale, np.float32(1.0))
        return np.clip(x / scale, -448, 448).astype(e4m3).astype(np.float64), scale.astype(np.float64)

    qv, qs = quantize(iq)  # [B, C, Hi, Hx]
    if keys_fp8:
        kv, ks = np.clip(ik.astype(np.float32), -448, 448).astype(e4m3).astype(np.float64), np.ones(ik.shape[:2] + (1,))
    else:
        kv, ks = quantize(ik)
    s = np.einsum("bchx,bsx->bhcs", qv, kv) * qs.transpose(0, 2, 1, 3) * ks[:, None, None, :, 0]
    s = np.where(np.arange(ik.shape[1])[None, None, None] > q_pos[:, None, :, None], -np.inf, s)
    nb = -(-ik.shape[1] // block_size)
    s = np.pad(s, [(0, 0)] * 3 + [(0, nb * block_size - ik.shape[1])], constant_values=-np.inf)
    return s.reshape(*s.shape[:3], nb, block_size).max(-1)


# shapes the MSA kernels take (G = 8, head dims 64, block 64), small enough for interpret mode
KERNEL_CFG = tiny_config(hidden_size=64, num_attention_heads=16, num_key_value_heads=2, head_dim=64, index_n_heads=2,
                         index_head_dim=64, index_block_size=64, index_topk_blocks=2)


def _inputs(rng, b=2, t=200, hi=4, hx=128):
    iq = rng.normal(0, 1, (b, t, hi, hx)).astype(np.float32)
    ik = rng.normal(0, 1.5, (b, t, hx)).astype(np.float32)
    iq[0, 5, 1] = 0.0  # a zero query row: its scale is guarded (scores 0, not NaN)
    return iq, ik, np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()


@pytest.mark.parametrize("keys_fp8", [False, True])
def test_fp8_scores_match_numpy(keys_fp8):
    iq, ik, pos = _inputs(np.random.default_rng(0))
    got = np.asarray(reference.block_scores(jnp.asarray(iq), jnp.asarray(ik), jnp.asarray(pos), 16,
                                            score_dtype=FP8_NAME, keys_fp8=keys_fp8))
    want = _numpy_fp8_block_scores(iq, ik, pos, 16, keys_fp8)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    # fp32 sums of exact e4m3 products against float64 ones: fp32 tolerance of the row's magnitude
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5 * np.abs(want[fin]).max())
    assert (got[0, 1, 5][np.isfinite(got[0, 1, 5])] == 0).all()  # the zero query row
    bf = np.asarray(reference.block_scores(jnp.asarray(iq), jnp.asarray(ik), jnp.asarray(pos), 16))
    assert not np.allclose(got[fin], bf[fin], rtol=1e-3)  # quantisation happened


def test_quantize_e4m3_roundtrip():
    x = np.random.default_rng(1).normal(0, 3, (64, 128)).astype(np.float32)
    v, s = reference.quantize_e4m3(jnp.asarray(x))
    assert v.dtype == jnp.float8_e4m3fn and s.shape == (64, 1)
    assert np.array_equal(np.abs(np.asarray(v, np.float32)).max(-1), np.full(64, 448.0, np.float32))  # row max on 448
    err = np.abs(np.asarray(v, np.float32) * np.asarray(s) - x)
    normal = np.abs(x) >= 2.0**-6 * np.asarray(s)  # e4m3 normal range, scaled
    assert (err[normal] <= compare.U_E4M3 * np.abs(x[normal]) * (1 + 1e-6)).all()


def test_bf16_default_unchanged():
    cfg = tiny_config()
    t = cfg.text
    assert t.index_score_dtype == "bfloat16"
    iq, ik, pos = (jnp.asarray(a) for a in _inputs(np.random.default_rng(2), t=96, hi=t.index_n_heads,
                                                       hx=t.index_head_dim))
    plain = reference.block_scores(iq, ik, pos, t.index_block_size)  # the score path as it was
    np.testing.assert_array_equal(np.asarray(msa_layer.scores(iq, ik, pos, t)), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(msa_layer.select(iq, ik, pos, t, 1)),
                                  np.asarray(reference.select_blocks(plain, pos, block_size=t.index_block_size,
                                                                     topk=t.index_topk_blocks)))


def test_fp8_selections_mostly_equal_near_ties_explained():
    # M3's index shapes (4 heads, Hx 128), block 16 / top-4 over 384 tokens (24 blocks).
    rng = np.random.default_rng(3)
    iq, ik, pos = (jnp.asarray(a) for a in _inputs(rng, b=1, t=384))
    full = tiny_config(num_attention_heads=4, num_key_value_heads=4, index_n_heads=4, index_head_dim=128,
                       index_block_size=16, index_topk_blocks=4)
    cfg, fp8 = full.text, full.replace_text(index_score_dtype=FP8_NAME).text
    bf_scores = msa_layer.scores(iq, ik, pos, cfg)
    sel_bf = msa_layer.select_from_scores(bf_scores, pos, cfg, 1)
    sel_8 = msa_layer.select(iq, ik, pos, fp8, 1)
    scale = reference.block_scores(jnp.abs(iq), jnp.abs(ik), pos, 16)
    scale = jnp.max(jnp.where(jnp.isfinite(scale), scale, 0.0), -1)
    diff = compare.compare_selections(sel_8, sel_bf, bf_scores, pos, 16, scale, compare.fp8_score_bound(128))
    assert diff.differing > 0  # the quantisation reaches the selections at all
    assert diff.unexplained == 0, diff  # every differing row is a near-tie under the fp8 bound
    assert diff.differing / diff.rows <= 0.2, diff


def test_fp8_through_the_cache_matches_forward():
    # A cached read (fp8 pages, keys as stored) and the forward pass's keys score alike under the fp8 indexer.
    t = tiny_config().text
    t8 = tiny_config().replace_text(index_score_dtype=FP8_NAME, index_cache_dtype=FP8_NAME).text
    iq, ik, pos = (jnp.asarray(a) for a in _inputs(np.random.default_rng(4), b=1, t=48, hi=t.index_n_heads,
                                                       hx=t.index_head_dim))
    pages = ik.astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(cached_block_scores(iq, pages, pos, t8)),
                                  np.asarray(cached_block_scores(iq, ik, pos, t8)))
    want = _numpy_fp8_block_scores(np.asarray(iq), np.asarray(ik), np.asarray(pos), t.index_block_size, True)
    got = np.asarray(cached_block_scores(iq, ik, pos, t8))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-4)


def test_config_validation_and_kernel_refusal():
    cfg = tiny_config()
    with pytest.raises(UnsupportedConfigError, match=r"index_score_dtype='float16'.*choose one of"):
        cfg.replace_text(index_score_dtype="float16")
    from m3jax.msa import kernels

    # the prefill kernels take the fp8 indexer (an e4m3 MMA); the paged decode scoring kernels do not,
    # so a decode step runs the prefill kernels over the gathered cache
    fp8 = KERNEL_CFG.replace_text(index_score_dtype=FP8_NAME)
    assert kernels.unsupported_reason(fp8.text) is None
    assert "reads fp8 index pages" in kernels.decode_unsupported_reason(fp8.text)  # a bf16 index cache
    with pytest.raises(UnsupportedConfigError, match="MSA decode kernels: index_score_dtype"):
        kernels.decode(None, None, None, None, None, fp8.text)
    # an fp8 index cache: read in place by the decode scoring kernel (Hopper; the CPU's target)
    assert kernels.decode_unsupported_reason(fp8.replace_text(index_cache_dtype=FP8_NAME).text) is None
    # an index head dim the fp8 MMA cannot take: "auto" runs the reference, "pallas" is refused
    small = cfg.replace_text(index_score_dtype=FP8_NAME, index_head_dim=16)
    assert "index_score_dtype='float8_e4m3fn': index_head_dim 16" in kernels.unsupported_reason(small.text)
    with pytest.raises(UnsupportedConfigError, match="index_score_dtype"):
        m3jax.api.resolve_attention_impl("pallas", small)
    with pytest.raises(ValueError, match="score_dtype"):
        reference.block_scores(jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 4)), jnp.arange(2)[None], 2, score_dtype="fp8")


def test_override_parses():
    from m3jax import cli, generate, needle

    assert cli.parse_overrides("index_score_dtype=float8_e4m3fn,topk=4") == {
        "index_score_dtype": FP8_NAME, "index_topk_blocks": 4}
    argv = ["--config-override", "index_score_dtype=float8_e4m3fn"]
    for args in (needle.build_parser().parse_args(argv), generate.parse_args(argv)):
        assert args.config_override == {"index_score_dtype": FP8_NAME}
        assert cli.apply_overrides(tiny_config(), args.config_override).text.index_score_dtype == FP8_NAME
    with pytest.raises(cli.UsageError, match="index_score_dtyp"):
        cli.apply_overrides(tiny_config(), {"index_score_dtyp": FP8_NAME})
    with pytest.raises(cli.UsageError, match="index_score_dtype='int8'; choose one of"):
        cli.apply_overrides(tiny_config(), {"index_score_dtype": "int8"})


@pytest.mark.parametrize("cache", ["bfloat16", FP8_NAME])
def test_kernels_path_runs_the_fp8_indexer(cache):
    # attention_impl="pallas" under the fp8 indexer: the prefill index-score kernel's e4m3 MMA, whose
    # selections are the reference path's except counted near-ties (the kernel's fp8 accumulation
    # bound, m3jax.pallas.tolerances), and the same attention where they agree.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.msa import kernels
    from m3jax.pallas import _backend
    from m3jax.pallas.tolerances import TOL

    cfg = KERNEL_CFG.replace_text(index_score_dtype=FP8_NAME, index_cache_dtype=cache)
    t = cfg.text
    b, s, hx, kh = 1, 256, t.index_head_dim, t.num_key_value_heads
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(0, 1, (b, s, n, t.head_dim)), jnp.bfloat16)
               for n in (t.num_attention_heads, kh, kh))
    iq = jnp.asarray(rng.normal(0, 1, (b, s, kh, hx)), jnp.bfloat16)
    ik = jnp.asarray(rng.normal(0, 1.5, (b, s, hx)), jnp.bfloat16)
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    calls = []
    real = kernels.index_select_blocks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "index_select_blocks", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
        o, sel = msa_layer.attention(q, k, v, iq, ik, pos, cfg.replace(attention_impl="pallas"), 1)
    assert not _backend.interpret_races_found()
    assert calls and calls[0]["score_dtype"] == FP8_NAME and calls[0]["keys_fp8"] == (cache == FP8_NAME)
    o_ref, sel_ref = msa_layer.attention(q, k, v, iq, ik, pos, cfg.replace(attention_impl="reference"), 1)
    scores = msa_layer.scores(iq, ik, pos, t)
    scale = reference.block_scores(jnp.abs(iq), jnp.abs(ik), pos, t.index_block_size)
    scale = jnp.max(jnp.where(jnp.isfinite(scale), scale, 0.0), -1)
    bound = 2 * hx * TOL[("index_scores", FP8_NAME)]
    diff = compare.compare_selections(sel, sel_ref, scores, pos, t.index_block_size, scale, bound)
    assert diff.unexplained == 0, diff
    as_sets = lambda x: np.sort(np.where(np.asarray(x) >= 0, np.asarray(x), s), -1)  # noqa: E731
    same = (as_sets(sel) == as_sets(sel_ref)).all(-1).all(1)  # [B, T]: every group selects alike
    assert same.mean() >= 0.9, (same.mean(), diff)  # most rows: near-ties are rare at random inputs
    np.testing.assert_allclose(np.asarray(o, np.float32)[same], np.asarray(o_ref, np.float32)[same],
                               **TOL[("attention", "bfloat16")])


def test_decode_kernels_run_the_fp8_indexer_in_place():
    # A decode step under the fp8 indexer over an fp8 index cache: the paged scoring kernel's e4m3 x
    # e4m3 path (msa_decode_select="fused" has none: the scoring and top-k kernels run), selections the
    # reference's except counted near-ties.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.cache import LayerCache
    from m3jax.msa import kernels
    from m3jax.pallas import _backend
    from m3jax.pallas import decode as D
    from m3jax.pallas.tolerances import TOL

    t = KERNEL_CFG.replace_text(index_score_dtype=FP8_NAME, index_cache_dtype=FP8_NAME,
                                msa_decode_select="fused").text
    bs, hx, kh, b, pages = t.index_block_size, t.index_head_dim, t.num_key_value_heads, 2, 8
    rng = np.random.default_rng(6)
    k, v = (jnp.asarray(rng.normal(0, 1, (pages, bs, kh, t.head_dim)), jnp.bfloat16) for _ in range(2))
    ik = jnp.asarray(rng.normal(0, 1.5, (pages, bs, hx))).astype(jnp.float8_e4m3fn)
    table = jnp.asarray(rng.permutation(pages).reshape(b, pages // b), jnp.int32)
    q_pos = jnp.asarray([[150], [255]], jnp.int32)
    q = jnp.asarray(rng.normal(0, 1, (b, 1, t.num_attention_heads, t.head_dim)), jnp.bfloat16)
    iq = jnp.asarray(rng.normal(0, 1, (b, 1, kh, hx)), jnp.bfloat16)
    calls = []
    real = kernels.decode_score_select
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "decode_score_select", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
        _, sel = kernels.decode(q, iq, LayerCache(k, v, ik), table, q_pos, t)
    assert not _backend.interpret_races_found()
    assert calls and calls[0]["score_dtype"] == FP8_NAME
    scores = D.decode_index_scores(iq, ik, table, q_pos[:, 0] + 1, block_size=bs, score_dtype=FP8_NAME,
                                   implementation="reference")
    ref = reference.select_blocks(scores, q_pos, block_size=bs, topk=t.index_topk_blocks)
    gathered = D.reference.gather_pages(ik, table).astype(jnp.float32)
    scale = reference.block_scores(jnp.abs(iq), jnp.abs(gathered), q_pos, bs)
    scale = jnp.max(jnp.where(jnp.isfinite(scale), scale, 0.0), -1)
    diff = compare.compare_selections(sel, ref, scores, q_pos, bs, scale, 2 * hx * TOL[("index_scores", FP8_NAME)])
    assert diff.unexplained == 0, diff


def test_decode_says_when_it_gathers_the_cache():
    """The fp8 indexer over a bf16 index cache has no in-place decode scoring: an MSA layer's decode
    step gathers the key window (an order of magnitude slower at 1M), with one warning naming why; a
    full-attention layer scores no index keys and still reads its pages in place."""
    fp8 = KERNEL_CFG.replace_text(index_score_dtype=FP8_NAME)
    q = jnp.zeros((1, 1, fp8.text.num_attention_heads, fp8.text.head_dim), jnp.bfloat16)
    pallas = msa_layer.VARIANTS["pallas"]
    msa_layer._FALLBACK_WARNED.clear()
    with pytest.warns(RuntimeWarning, match="MSA decode gathers the paged cache every step.*reads fp8 index pages"):
        assert not msa_layer._in_place(pallas, fp8, q, sparse=True)
    assert msa_layer._in_place(pallas, fp8, q, sparse=False)
    both = fp8.replace_text(index_cache_dtype=FP8_NAME)
    assert msa_layer._in_place(pallas, both, q, sparse=True) and msa_layer._in_place(pallas, both, q, sparse=False)
