"""MSA through the Mosaic GPU kernels of :mod:`m3jax.pallas`, and which configs they take.

Same semantics as :mod:`m3jax.msa.reference` (selections equal as sets, attention within the
tolerances of docs/MSA.md §4.3); the model chooses between the two in :mod:`m3jax.msa.layer`.
"""

from __future__ import annotations

import jax

from m3jax.cache import LayerCache
from m3jax.config import TextConfig, UnsupportedConfigError

# The top-k kernels keep a row's list in registers (topk values + topk ids per thread): 64, the largest
# top-k of the research grid (experiments/2026-11-29_block_topk), is the largest we test.
MAX_TOPK = 64


def _score_dtype_reason(cfg: TextConfig) -> str | None:
    """The index-score kernels multiply bf16 (or fp32 split into bf16) operands: the fp8 indexer is the
    jnp reference's only, so a kernel never computes it in bf16 instead."""
    if cfg.index_score_dtype != "bfloat16":
        return (f"index_score_dtype={cfg.index_score_dtype!r} has no index-score kernel; the fp8 indexer "
                "runs on the jnp reference path")
    return None


def _refuse_score_dtype(cfg: TextConfig) -> None:
    if reason := _score_dtype_reason(cfg):
        raise UnsupportedConfigError(f"MSA kernels: {reason}")


def _selection_reason(cfg: TextConfig) -> str | None:
    """What the prefill index-score and top-k kernels cannot take (None when they can)."""
    from m3jax.pallas.index_scores import IndexScoreConfig

    if reason := _score_dtype_reason(cfg):
        return reason
    rows = IndexScoreConfig().rows
    if cfg.index_head_dim not in (16, 32) and cfg.index_head_dim % 64:
        return (f"index_head_dim {cfg.index_head_dim} must be 16, 32 or a multiple of 64 (rows of 32 or 64 bytes, "
                "or 128-byte swizzle atoms)")
    if cfg.index_block_size % 16 or cfg.index_block_size > 256:
        return f"index_block_size {cfg.index_block_size} must be a multiple of 16 up to 256 (one wgmma N tile)"
    if not 1 <= cfg.index_topk_blocks <= MAX_TOPK:
        return f"index_topk_blocks {cfg.index_topk_blocks} must be in 1..{MAX_TOPK} (per-row register lists)"
    if rows % cfg.index_n_heads:
        return f"index_n_heads {cfg.index_n_heads} must divide the {rows}-row index-score tile"
    return None


def unsupported_reason(cfg: TextConfig, dtype="bfloat16") -> str | None:
    """Why the MSA prefill kernels (index scores, top-k, sparse attention) cannot run this config in
    ``dtype``, or a kernel failed its self-check on this GPU (None when they can). The in-place decode
    kernels have their own :func:`decode_unsupported_reason`: without them a decode step runs these
    kernels over the gathered cache. ``msa_force_in`` / ``msa_force_out`` reach the top-k kernels as
    static tuples (:func:`prefill`)."""
    from m3jax.pallas.sparse_attention.kernel import unsupported_reason as attention_reason

    reason = _selection_reason(cfg) or attention_reason(
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        block_size=cfg.index_block_size, dtype=dtype)
    if reason:
        return reason
    from m3jax.pallas import canaries, verdicts  # a kernel that fails its canary on this GPU is not used

    return verdicts.kernel_failure(*canaries.MSA_PREFILL_KERNELS)


def decode_unsupported_reason(cfg: TextConfig) -> str | None:
    """Why the paged decode kernels cannot read this config's cache in place, or one failed its
    self-check on this GPU (None when they can): the index-score kernel puts a page's keys on the wgmma
    M side (64 rows), and the attention kernel's key tiles are multiples of 64."""
    if reason := _score_dtype_reason(cfg):
        return reason
    if cfg.index_block_size % 64:
        return f"index_block_size {cfg.index_block_size} is not a multiple of 64 (a page is the decode kernels' wgmma M tile)"
    if cfg.index_head_dim % 64:
        return f"index_head_dim {cfg.index_head_dim} must be a multiple of 64 (128-byte swizzled index-key pages)"
    if cfg.head_dim % 64 or cfg.head_dim > 256:
        return f"head_dim {cfg.head_dim} must be a multiple of 64 up to 256"
    from m3jax.pallas import canaries, verdicts  # failing decode kernels: decode runs the prefill kernels over the gathered cache

    return verdicts.kernel_failure(*canaries.MSA_DECODE_KERNELS)


def prefill(q, k, v, iq, ik, q_pos, cfg: TextConfig, force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = ()):
    """Index scores, top-k and KV-block-major sparse attention over a whole query range.

    q [B, T, N, H], k/v [B, S, K, H], iq [B, T, K, Hx], ik [B, S, Hx], q_pos [B, T]; ``force_in`` /
    ``force_out``: the layer's intervention block ids (:func:`m3jax.msa.layer.forced_blocks`). The
    kernels tile the query range themselves. Returns (o [B, T, N, H], block ids int32 [B, K, T, topk]).
    """
    from m3jax.pallas.index_scores import index_select_blocks
    from m3jax.pallas.sparse_attention import sparse_attention

    _refuse_score_dtype(cfg)
    bs = cfg.index_block_size
    # Fused scores + top-k: the kernel's block-major scores go straight into the top-k kernel, never
    # transposed to [B, Hi, T, nb] (1 GiB per 8K-token chunk at 1M context).
    sel = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=cfg.index_topk_blocks,
                              local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks,
                              force_in=force_in, force_out=force_out)
    return sparse_attention(q, k, v, sel, q_pos, block_size=bs, implementation="kv_major"), sel


def decode(q, iq, kv: LayerCache, page_table: jax.Array, q_pos: jax.Array, cfg: TextConfig,
           force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = ()):
    """One decode token per sequence through the paged decode kernels: the index keys and the
    selected K/V pages are read in place, the cache is never gathered. ``force_in`` / ``force_out`` as
    in :func:`prefill`. Returns (o, block ids)."""
    from m3jax.pallas.decode import decode_index_scores, sparse_decode_attention
    from m3jax.pallas.topk import select_blocks

    _refuse_score_dtype(cfg)
    bs = cfg.index_block_size
    seq_lens = q_pos[:, -1] + 1
    # fp8 index pages (index_cache_dtype) go in as stored: the kernel converts each page in SMEM
    # (exact), so the scan reads one byte per key element.
    scores = decode_index_scores(iq, kv.ik, page_table, seq_lens, block_size=bs)
    sel = select_blocks(scores, q_pos, block_size=bs, topk=cfg.index_topk_blocks,
                        local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks,
                        force_in=force_in, force_out=force_out, implementation="pallas")
    return sparse_decode_attention(q, kv.k, kv.v, page_table, sel, seq_lens, block_size=bs), sel


def dense_decode(q, kv: LayerCache, page_table: jax.Array, q_pos: jax.Array, cfg: TextConfig) -> jax.Array:
    """Full causal attention of one decode token per sequence (the full-attention layers), reading the
    K/V pages in place: the paged decode attention kernel with every block up to the token's own
    selected, so the cache is never gathered into a contiguous copy. Returns o [B, 1, N, H]."""
    from m3jax.pallas.decode import sparse_decode_attention

    bs = cfg.index_block_size
    blocks = jax.numpy.arange(page_table.shape[1], dtype=jax.numpy.int32)[None]
    sel = jax.numpy.where(blocks <= q_pos[:, -1:] // bs, blocks, -1)  # [B, max_pages], -1: in the future
    sel = jax.numpy.broadcast_to(sel[:, None, None], (q.shape[0], kv.k.shape[2], 1, blocks.shape[1]))
    return sparse_decode_attention(q, kv.k, kv.v, page_table, sel, q_pos[:, -1] + 1, block_size=bs)
