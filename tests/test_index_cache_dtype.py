"""``index_cache_dtype="float8_e4m3fn"``: the index-key pages take half the bytes, a cache read and a
forward pass score from the same rounded keys, and selections mostly agree with bf16 keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import m3jax
from m3jax.cache import FP8, cache_bytes, cached_index_keys, init_cache
from m3jax.config import UnsupportedConfigError
from m3jax.msa import layer as msa_layer, reference
from tests.conftest import tiny_config

FP8_NAME = "float8_e4m3fn"


def test_cache_bytes_halve():
    cfg = tiny_config()
    fp8 = cfg.replace_text(index_cache_dtype=FP8_NAME)
    bf = init_cache(cfg, 2, 64, jnp.bfloat16)
    c8 = init_cache(fp8, 2, 64, jnp.bfloat16)
    index = lambda c: sum(lc.ik.nbytes for lc in c.layers if lc.ik is not None)  # noqa: E731
    assert all(lc.ik.dtype == FP8 for lc in c8.layers if lc.ik is not None)
    assert all(a.k.dtype == b.k.dtype == jnp.bfloat16 for a, b in zip(bf.layers, c8.layers))  # K/V untouched
    assert index(c8) * 2 == index(bf) > 0
    total = lambda c: sum(x.nbytes for x in jax.tree.leaves(c.layers))  # noqa: E731
    assert total(bf) == cache_bytes(cfg, 2, 64) and total(c8) == cache_bytes(fp8, 2, 64)
    with pytest.raises(UnsupportedConfigError, match="index_cache_dtype"):
        cfg.replace_text(index_cache_dtype="float16")


def test_memory_plan_counts_fp8_index_keys():
    # The planner's per-device cache equals the allocated cache for fp8 index keys too (it used the
    # K/V byte size for the index pages and asserted against cache_bytes).
    from m3jax import plan
    from m3jax.sharding import make_mesh

    fp8 = tiny_config().replace_text(index_cache_dtype=FP8_NAME)
    kv, index = plan.cache_per_device(fp8, make_mesh(1), batch=2, ctx=64, kv_bytes=2)
    _, index_bf = plan.cache_per_device(tiny_config(), make_mesh(1), batch=2, ctx=64, kv_bytes=2)
    assert kv + index == cache_bytes(fp8, 2, 64) and index * 2 == index_bf > 0


def test_cache_read_scores_like_forward():
    # Index keys written to fp8 pages and gathered back score exactly like the forward pass's rounded keys.
    cfg = tiny_config().replace_text(index_cache_dtype=FP8_NAME)
    t = cfg.text
    rng = np.random.default_rng(0)
    ik = jnp.asarray(rng.normal(0, 2, (1, 12, t.index_head_dim)), jnp.float32).at[0, 3, 0].set(1e4)  # one out of range
    iq = jnp.asarray(rng.normal(0, 1, (1, 12, t.index_n_heads, t.index_head_dim)), jnp.float32)
    pos = jnp.arange(12)[None]
    cache = init_cache(cfg, 1, 12, jnp.float32).layers[1]
    cache = cache.write(jnp.arange(3)[None], pos, jnp.zeros((1, 12, t.num_key_value_heads, t.head_dim)),
                        jnp.zeros((1, 12, t.num_key_value_heads, t.head_dim)), ik)
    gathered = cache.gather(jnp.arange(3)[None])[2]
    assert gathered.dtype == FP8 and bool(jnp.isfinite(gathered.astype(jnp.float32)).all())  # clipped, not NaN
    got = reference.block_scores(iq, gathered, pos, t.index_block_size)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(msa_layer.scores(iq, ik, pos, t)))
    assert np.array_equal(np.asarray(cached_index_keys(gathered, t)), np.asarray(gathered.astype(jnp.float32)))
    assert not np.array_equal(np.asarray(cached_index_keys(ik, t)), np.asarray(ik))  # rounding happened


def test_selection_agreement_with_bf16_keys():
    cfg = tiny_config(vocab_size=64, index_block_size=4, index_topk_blocks=3).replace(
        image_token_id=62, video_token_id=63, attention_impl="reference")
    model = m3jax.init_random(cfg, seed=1)
    ids = np.random.default_rng(0).integers(3, 60, (2, 96))
    ref = m3jax.forward(model, ids, return_block_indices=True).block_indices
    fp8 = m3jax.forward(m3jax.M3Model(cfg.replace_text(index_cache_dtype=FP8_NAME), model.params), ids,
                        return_block_indices=True).block_indices
    rows_equal = []
    for layer, sel in ref.items():
        a, b = np.sort(np.asarray(sel), -1), np.sort(np.asarray(fp8[layer]), -1)
        rows_equal.append((a == b).all(-1).mean())
    # e4m3 keeps 3 mantissa bits: near-ties flip, the rest of the selections stay.
    assert np.mean(rows_equal) >= 0.8, rows_equal


def test_decode_kernels_read_fp8_pages(monkeypatch):
    # The model's in-place decode (msa.kernels.decode, GPU interpret mode here) hands the fp8 pages to
    # the index-score kernel as stored (no upcast pass: the kernel converts each page in SMEM) and
    # selects what the reference selects from the same pages.
    from m3jax.cache import LayerCache
    from m3jax.msa import kernels

    t = m3jax.preset("m3_width").replace_text(
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, index_n_heads=2, index_head_dim=64,
        index_block_size=64, index_topk_blocks=2, index_cache_dtype=FP8_NAME).text
    seen, select = [], kernels.decode_score_select

    def spy(iq, ik, *a, **kw):
        seen.append(ik.dtype)
        return select(iq, ik, *a, **kw)

    monkeypatch.setattr(kernels, "decode_score_select", spy)  # the name msa.kernels composes
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)

    kv = LayerCache(normal(4, 64, 2, 64), normal(4, 64, 2, 64), normal(4, 64, 64).astype(FP8))
    table, pos = jnp.array([[2, 0, 3, 1]], jnp.int32), jnp.array([[200]], jnp.int32)
    q, iq = normal(1, 1, 8, 64), normal(1, 1, 2, 64)
    _, sel = jax.jit(lambda q, iq, kv: kernels.decode(q, iq, kv, table, pos, t))(q, iq, kv)
    assert seen == [FP8]
    want = reference.select_blocks(reference.block_scores(iq, kv.gather(table)[2], pos, 64), pos, block_size=64, topk=2)
    np.testing.assert_array_equal(np.sort(np.asarray(sel), -1), np.sort(np.asarray(want), -1))
