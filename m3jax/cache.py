"""Paged KV cache and MSA index-key cache (page = MSA block).

Per attention layer: K and V pages [P, block, K, H]; per MSA layer also index-key pages
[P, block, Hx] (one shared index-key head, cached after norm and RoPE like K). A page table
[B, max_pages] maps logical block j of sequence b to a physical page, so the sparse kernels can
fetch a selected block as one page. Token at position p of sequence b lives in page
page_table[b, p // block], slot p % block. Writes beyond a sequence's pages are dropped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from m3jax.config import M3Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    k: jax.Array  # [P, bs, K, H]
    v: jax.Array  # [P, bs, K, H]
    ik: jax.Array | None  # [P, bs, Hx] on MSA layers, None on dense layers

    def write(self, page_table: jax.Array, positions: jax.Array, k, v, ik) -> "LayerCache":
        """Store new tokens. page_table [B, maxp]; positions [B, T]; k, v [B, T, K, H]; ik [B, T, Hx]."""
        bs = self.k.shape[1]
        blk = positions // bs
        in_range = (positions >= 0) & (blk < page_table.shape[1])
        page = jnp.take_along_axis(page_table, jnp.clip(blk, 0, page_table.shape[1] - 1), axis=1)
        page = jnp.where(in_range, page, self.k.shape[0])  # out-of-range index: dropped
        slot = positions % bs
        put = lambda pages, x: pages.at[page, slot].set(x.astype(pages.dtype), mode="drop")  # noqa: E731
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
        ik = jnp.zeros((n_pages, bs, t.index_head_dim), dtype) if t.is_sparse_attention(i) else None
        layers.append(LayerCache(jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype), ik))
    page_table = jnp.arange(n_pages, dtype=jnp.int32).reshape(batch, max_pages)
    return PagedCache(layers, page_table)


def cache_bytes(cfg: M3Config, batch: int, capacity: int, dtype_bytes: int = 2) -> int:
    """Bytes of :func:`init_cache` without allocating it."""
    t = cfg.text
    bs = t.index_block_size
    tokens = batch * -(-capacity // bs) * bs
    per_token = 0
    for i in range(t.num_hidden_layers):
        per_token += 2 * t.num_key_value_heads * t.head_dim
        if t.is_sparse_attention(i):
            per_token += t.index_head_dim
    return tokens * per_token * dtype_bytes
