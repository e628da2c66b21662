"""MSA through the Mosaic GPU kernels of :mod:`m3jax.pallas`, and which configs they take.

Same semantics as :mod:`m3jax.msa.reference` (selections equal as sets, attention within the
tolerances of docs/MSA.md §4.3); the model chooses between the two in :mod:`m3jax.msa.layer`.
"""

from __future__ import annotations

import jax

from m3jax.cache import LayerCache
from m3jax.config import TextConfig


def unsupported_reason(cfg: TextConfig) -> str | None:
    """Why the MSA kernels cannot run this config (None when they can)."""
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    if g % 8:
        return f"query heads per KV head = {g} must be a multiple of 8 (GQA rows packed into wgmma tiles)"
    if cfg.head_dim % 64 or cfg.index_head_dim % 64:
        return f"head_dim {cfg.head_dim} and index_head_dim {cfg.index_head_dim} must be multiples of 64"
    if cfg.index_block_size % 64 or cfg.index_block_size > 256:
        return f"index_block_size {cfg.index_block_size} must be 64, 128, 192 or 256"
    if cfg.msa_force_in or cfg.msa_force_out:
        return "msa_force_in / msa_force_out interventions run on the reference path only"
    from m3jax import selfcheck  # a kernel that fails its canary on this GPU is not used

    return selfcheck.kernel_failure(*selfcheck.MSA_KERNELS)


def prefill(q, k, v, iq, ik, q_pos, cfg: TextConfig):
    """Index scores, top-k and KV-block-major sparse attention over a whole query range.

    q [B, T, N, H], k/v [B, S, K, H], iq [B, T, K, Hx], ik [B, S, Hx], q_pos [B, T]. The kernels tile
    the query range themselves. Returns (o [B, T, N, H], block ids int32 [B, K, T, topk]).
    """
    from m3jax.pallas.index_scores import index_select_blocks
    from m3jax.pallas.sparse_attention import sparse_attention

    bs = cfg.index_block_size
    # Fused scores + top-k: the kernel's block-major scores go straight into the top-k kernel, never
    # transposed to [B, Hi, T, nb] (1 GiB per 8K-token chunk at 1M context).
    sel = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=cfg.index_topk_blocks,
                              local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks)
    return sparse_attention(q, k, v, sel, q_pos, block_size=bs, implementation="kv_major"), sel


def decode(q, iq, kv: LayerCache, page_table: jax.Array, q_pos: jax.Array, cfg: TextConfig):
    """One decode token per sequence through the paged decode kernels: the index keys and the
    selected K/V pages are read in place, the cache is never gathered. Returns (o, block ids)."""
    from m3jax.pallas.decode import decode_index_scores, sparse_decode_attention
    from m3jax.pallas.topk import select_blocks

    bs = cfg.index_block_size
    seq_lens = q_pos[:, -1] + 1
    # fp8 index pages (index_cache_dtype): the kernel takes 16-bit pages only, so they are upcast here
    # (exact), in one XLA pass over the index cache; reading fp8 pages in the kernel is its work list.
    ik_pages = kv.ik if kv.ik.dtype == iq.dtype else kv.ik.astype(iq.dtype)
    scores = decode_index_scores(iq, ik_pages, page_table, seq_lens, block_size=bs)
    sel = select_blocks(scores, q_pos, block_size=bs, topk=cfg.index_topk_blocks,
                        local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks,
                        implementation="pallas")
    return sparse_decode_attention(q, kv.k, kv.v, page_table, sel, seq_lens, block_size=bs), sel
