"""Paged KV cache and MSA index-key cache (page = MSA block).

Per attention layer: K and V pages [P, block, K, H]; per MSA layer also index-key pages
[P, block, Hx] (one shared index-key head, cached after norm and RoPE like K). A page table
[B, max_pages] maps logical block j of sequence b to a physical page, so the sparse kernels can
fetch a selected block as one page. Token at position p of sequence b lives in page
page_table[b, p // block], slot p % block. Writes beyond a sequence's pages are dropped.

Index-key pages are stored in fp8 e4m3 when the config's ``index_cache_dtype`` is
``"float8_e4m3fn"`` (half the bytes the decode index scan reads); :func:`cached_index_keys` gives
every reader the keys exactly as such a cache holds them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from m3jax.config import M3Config, TextConfig
from m3jax.msa.reference import FP8, block_scores, to_e4m3

FP8_NAME = "float8_e4m3fn"


def index_page_dtype(cfg: TextConfig, dtype) -> jnp.dtype:
    """Storage dtype of the index-key pages of a cache whose K/V pages are ``dtype``."""
    return jnp.dtype(FP8) if cfg.index_cache_dtype == FP8_NAME else jnp.dtype(dtype)


def _store(x: jax.Array, dtype) -> jax.Array:
    """``x`` cast to a page dtype (clipped to the finite range first for fp8: a cast beyond it is NaN;
    index keys are RMS-normed, then scaled by the norm weight, far inside it)."""
    return to_e4m3(x) if jnp.dtype(dtype) == FP8 else x.astype(dtype)


def cached_index_keys(ik: jax.Array, cfg: TextConfig, dtype=None) -> jax.Array:
    """Index keys ``ik`` as the cache holds them (rounded to fp8 e4m3 under ``index_cache_dtype =
    "float8_e4m3fn"``), returned in ``dtype`` (default: ik's own dtype; fp8 keys default to fp32).
    The upcast is exact, so scores computed from the result are the fp8 cache's scores."""
    out = jnp.float32 if dtype is None and ik.dtype == FP8 else (dtype or ik.dtype)
    if cfg.index_cache_dtype == FP8_NAME:
        ik = _store(ik, FP8)
    return ik.astype(out)


def cached_block_scores(iq: jax.Array, ik: jax.Array, q_pos: jax.Array, cfg: TextConfig) -> jax.Array:
    """Index block scores fp32 [B, Hi, C, nb] of iq [B, C, Hi, Hx] at q_pos [B, C] against the index
    keys ik [B, S, Hx] as the cache holds them, multiplied in ``cfg.index_score_dtype``
    (:func:`m3jax.msa.reference.block_scores`; the fp8 indexer takes fp8 cache pages as stored)."""
    return block_scores(iq, cached_index_keys(ik, cfg), q_pos, cfg.index_block_size,
                        score_dtype=cfg.index_score_dtype, keys_fp8=cfg.index_cache_dtype == FP8_NAME)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    k: jax.Array  # [P, bs, K, H]
    v: jax.Array  # [P, bs, K, H]
    ik: jax.Array | None  # [P, bs, Hx] on MSA layers (fp8 under index_cache_dtype), None on dense layers

    def write(self, page_table: jax.Array, positions: jax.Array, k, v, ik) -> "LayerCache":
        """Store new tokens. page_table [B, maxp]; positions [B, T]; k, v [B, T, K, H]; ik [B, T, Hx]."""
        bs = self.k.shape[1]
        blk = positions // bs
        in_range = (positions >= 0) & (blk < page_table.shape[1])
        page = jnp.take_along_axis(page_table, jnp.clip(blk, 0, page_table.shape[1] - 1), axis=1)
        page = jnp.where(in_range, page, self.k.shape[0])  # out-of-range index: dropped
        slot = positions % bs
        put = lambda pages, x: pages.at[page, slot].set(_store(x, pages.dtype), mode="drop")  # noqa: E731
        return LayerCache(put(self.k, k), put(self.v, v), None if self.ik is None else put(self.ik, ik))

    def gather(self, page_table: jax.Array):
        """Contiguous views [B, maxp * bs, ...] in position order (slot s = position s)."""
        def g(pages):
            x = pages[page_table]  # [B, maxp, bs, ...]
            return x.reshape(x.shape[0], -1, *x.shape[3:])

        return g(self.k), g(self.v), None if self.ik is None else g(self.ik)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCache:
    layers: list[LayerCache]
    page_table: jax.Array  # int32 [B, max_pages]


def init_cache(cfg: M3Config, batch: int, capacity: int, dtype=jnp.bfloat16) -> PagedCache:
    """Zeroed cache for ``batch`` sequences of up to ``capacity`` tokens (rounded up to whole pages).

    Pages are handed out contiguously per sequence; the page table is what every reader uses.
    """
    t = cfg.text
    bs = t.index_block_size
    max_pages = -(-capacity // bs)
    n_pages = batch * max_pages
    layers = []
    for i in range(t.num_hidden_layers):
        kv_shape = (n_pages, bs, t.num_key_value_heads, t.head_dim)
        ik = jnp.zeros((n_pages, bs, t.index_head_dim), index_page_dtype(t, dtype)) if t.is_sparse_attention(i) else None
        layers.append(LayerCache(jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype), ik))
    page_table = jnp.arange(n_pages, dtype=jnp.int32).reshape(batch, max_pages)
    return PagedCache(layers, page_table)


def cache_bytes(cfg: M3Config, batch: int, capacity: int, dtype_bytes: int = 2) -> int:
    """Bytes of :func:`init_cache` without allocating it (K/V pages of ``dtype_bytes`` per value)."""
    t = cfg.text
    bs = t.index_block_size
    tokens = batch * -(-capacity // bs) * bs
    index_bytes = 1 if t.index_cache_dtype == FP8_NAME else dtype_bytes
    per_token = 0
    for i in range(t.num_hidden_layers):
        per_token += 2 * t.num_key_value_heads * t.head_dim * dtype_bytes
        if t.is_sparse_attention(i):
            per_token += t.index_head_dim * index_bytes
    return tokens * per_token
