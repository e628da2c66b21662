"""MSA through the Mosaic GPU kernels of :mod:`m3jax.pallas`, and which configs they take: the one
place that composes the kernels (prefill, differentiable attention over given selections for
training, the indexer objective's target mass, paged decode, full-attention decode, and the
per-device pieces of the context-parallel paths, :class:`m3jax.msa.parallel.Local`).

Same semantics as :mod:`m3jax.msa.reference` (selections equal as sets, attention within the
tolerances of docs/MSA.md §4.3); the model chooses between the two in :mod:`m3jax.msa.layer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax.cache import FP8_NAME, LayerCache
from m3jax.config import TextConfig, UnsupportedConfigError
from m3jax.msa.parallel import Local, local_window
from m3jax.pallas import canaries, verdicts
from m3jax.pallas.block_mass import block_mass
from m3jax.pallas.block_mass import unsupported_reason as mass_reason
from m3jax.pallas.decode import (
    decode_index_scores,
    decode_score_select,
    decode_select_blocks,
    fp8_scores_unsupported_reason,
    sparse_decode_attention,
)
from m3jax.pallas.index_scores import IndexScoreConfig, fp8_unsupported_reason, index_block_scores, index_select_blocks
from m3jax.pallas.sparse_attention import sparse_attention
from m3jax.pallas.sparse_attention.kernel import unsupported_reason as attention_reason

# The top-k kernels keep a row's list in registers (topk values + topk ids per thread): 64, the largest
# top-k of the research grid (experiments/2026-11-29_block_topk), is the largest we test.
MAX_TOPK = 64


def _score_dtype_reason(cfg: TextConfig) -> str | None:
    """The prefill index-score kernel multiplies bf16 operands (fp32 as bf16 pieces) or, for the fp8
    indexer, the reference's e4m3 operands (:func:`m3jax.pallas.index_scores.fp8_unsupported_reason`
    says where it cannot): never the fp8 indexer's scores as a bf16 product."""
    if cfg.index_score_dtype == "bfloat16":
        return None
    if reason := fp8_unsupported_reason(cfg.index_head_dim):
        return f"index_score_dtype={cfg.index_score_dtype!r}: {reason}"
    return None


def _decode_score_dtype_reason(cfg: TextConfig) -> str | None:
    """The fp8 indexer's paged decode scoring reads an fp8 index cache in place (e4m3 x e4m3, Hopper);
    where it cannot (:func:`m3jax.pallas.decode.fp8_scores_unsupported_reason`) a decode step gathers
    the cache and runs the prefill kernels."""
    if cfg.index_score_dtype == "bfloat16":
        return None
    pages = jnp.float8_e4m3fn if cfg.index_cache_dtype == FP8_NAME else jnp.bfloat16
    if reason := fp8_scores_unsupported_reason(pages):
        return f"index_score_dtype={cfg.index_score_dtype!r}: {reason}"
    return None


def _score_args(cfg: TextConfig) -> dict:
    """The index-score kernels' score arguments: the product (``index_score_dtype``) and whether the
    keys are an fp8 index cache's, taken as stored (as :func:`m3jax.cache.cached_block_scores` does)."""
    return dict(score_dtype=cfg.index_score_dtype, keys_fp8=cfg.index_cache_dtype == FP8_NAME)


def _selection_reason(cfg: TextConfig) -> str | None:
    """What the prefill index-score and top-k kernels cannot take (None when they can)."""
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
    reason = _selection_reason(cfg) or attention_reason(
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        block_size=cfg.index_block_size, dtype=dtype, implementation="kv_major")
    if reason:
        return reason
    # a kernel whose canary fails here at the path this block takes is not used
    return verdicts.kernel_failure(*_prefill_kernels(cfg), block_size=cfg.index_block_size)


def decode_unsupported_reason(cfg: TextConfig) -> str | None:
    """Why the paged decode kernels cannot read this config's cache in place, or one failed its
    self-check on this GPU (None when they can): the index-score kernel puts a page's keys on the wgmma
    M side (64 rows), and the attention kernel's key tiles are multiples of 64."""
    if reason := _decode_score_dtype_reason(cfg):
        return reason
    if cfg.index_block_size % 64:
        return f"index_block_size {cfg.index_block_size} is not a multiple of 64 (a page is the decode kernels' wgmma M tile)"
    if cfg.index_head_dim % 64:
        return f"index_head_dim {cfg.index_head_dim} must be a multiple of 64 (128-byte swizzled index-key pages)"
    if cfg.head_dim % 64 or cfg.head_dim > 256:
        return f"head_dim {cfg.head_dim} must be a multiple of 64 up to 256"
    # failing decode kernels (the e4m3 scoring's too under the fp8 indexer): decode runs the prefill
    # kernels over the gathered cache
    return verdicts.kernel_failure(*_decode_kernels(cfg), block_size=cfg.index_block_size)


def _prefill_kernels(cfg: TextConfig) -> tuple[str, ...]:
    fp8 = canaries.FP8_INDEXER_PREFILL_KERNELS if cfg.index_score_dtype != "bfloat16" else ()
    return (*canaries.MSA_PREFILL_KERNELS, *fp8)


def _decode_kernels(cfg: TextConfig) -> tuple[str, ...]:
    fp8 = canaries.FP8_INDEXER_DECODE_KERNELS if cfg.index_score_dtype != "bfloat16" else ()
    return (*canaries.MSA_DECODE_KERNELS, *fp8)


def _fused_select(cfg: TextConfig) -> bool:
    """Whether decode asks for the fused selection (not under the fp8 indexer: it has no e4m3 product)."""
    return cfg.msa_decode_select == "fused" and cfg.index_score_dtype == "bfloat16"


def canary_kernels(cfg: TextConfig) -> tuple[str, ...]:
    """Every kernel whose self-check verdict this config's kernel path asks for, at
    ``cfg.index_block_size``: the prefill's, the in-place decode's (the full-attention layers' too) and
    the fused selection's when chosen; the fp8 indexer's when it is on."""
    fused = ("decode_select_fused",) if _fused_select(cfg) else ()
    return tuple(dict.fromkeys((*_prefill_kernels(cfg), *_decode_kernels(cfg), *fused)))


def prefill(q, k, v, iq, ik, q_pos, cfg: TextConfig, force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = ()):
    """Index scores, top-k and KV-block-major sparse attention over a whole query range.

    q [B, T, N, H], k/v [B, S, K, H], iq [B, T, K, Hx], ik [B, S, Hx], q_pos [B, T]; ``force_in`` /
    ``force_out``: the layer's intervention block ids (:func:`m3jax.msa.layer.forced_blocks`). The
    kernels tile the query range themselves. Returns (o [B, T, N, H], block ids int32 [B, K, T, topk]).
    """
    if reason := _score_dtype_reason(cfg):
        raise UnsupportedConfigError(f"MSA kernels: {reason}")
    bs = cfg.index_block_size
    # Fused scores + top-k: the kernel's block-major scores go straight into the top-k kernel, never
    # transposed to [B, Hi, T, nb] (1 GiB per 8K-token chunk at 1M context).
    sel = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=cfg.index_topk_blocks,
                              local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks,
                              force_in=force_in, force_out=force_out, **_score_args(cfg))
    return sparse_attention(q, k, v, sel, q_pos, block_size=bs, implementation="kv_major"), sel


def attend_selected(q, k, v, block_idx, q_pos, *, block_size: int):
    """Block-sparse attention over given selections through the KV-block-major kernel, differentiable
    w.r.t. q, k and v (the kernel's custom VJP: :mod:`m3jax.pallas.sparse_attention.backward`, or the
    reference gradient where that kernel cannot run); block_idx and q_pos get no gradient. What
    training calls: the selection is made outside (and is discrete).

    q [B, T, N, H], k/v [B, S, K, H], block_idx int32 [B, K, T, topk] (-1 = empty slot), q_pos [B, T].
    Returns o [B, T, N, H] in q.dtype.
    """
    return sparse_attention(q, k, v, block_idx, q_pos, block_size=block_size, implementation="kv_major")


def indexer_target_mass(q, k, q_pos, *, block_size: int, num_blocks: int):
    """The indexer objective's target mass through the block-mass kernel
    (:mod:`m3jax.pallas.block_mass`): the main branch's causal attention per key block, averaged over
    each KV group's heads, without the [T, S] softmax. What training passes to
    :func:`m3jax.indexer_objective.indexer_kl` as ``mass=``. q and k are ``stop_gradient``'d here (the
    target gets no gradient, and the kernel has none); where the kernel cannot run
    (:func:`m3jax.pallas.block_mass.unsupported_reason`) the reference computes it. Per query chunk
    (C of a few hundred rows is fine: the kernel splits the keys over CTAs when the chunk is short).

    q [B, C, N, H], k [B, S, K, H], q_pos int32 [B, C], num_blocks >= ceil(S / block_size).
    Returns fp32 [B, K, C, num_blocks].
    """
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    dtype = jnp.bfloat16 if q.dtype == k.dtype == jnp.bfloat16 else jnp.float32
    reason = mass_reason(num_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3], block_size=block_size,
                         dtype=dtype)
    return block_mass(q, k, q_pos, block_size=block_size, num_blocks=num_blocks,
                      implementation="reference" if reason else "kernel")


def decode_pages(q, iq, k_pages, v_pages, ik_pages, page_table, seq_lens, *, block_size: int, topk: int,
                 local_blocks: int = 1, init_blocks: int = 0, force_in: tuple[int, ...] = (),
                 force_out: tuple[int, ...] = (), fused_select: bool = False, score_dtype: str = "bfloat16",
                 q_pos: jax.Array | None = None):
    """One MSA decode step over paged caches, read in place: paged index scores -> top-k -> sparse
    paged attention. q [B, Q, N, H], iq [B, Q, Hi, Hx] (Hi == K), pages as the decode kernels take them
    (:mod:`m3jax.pallas.decode`), seq_lens [B]. ``fused_select``: the selection from one scan of the
    pages (:func:`m3jax.pallas.decode.decode_select_blocks`; ``TextConfig.msa_decode_select="fused"``)
    instead of the scoring kernel then the top-k kernel reading its rows in place
    (:func:`m3jax.pallas.decode.decode_score_select`); the same block ids either way.
    ``score_dtype="float8_e4m3fn"``: the fp8 indexer over fp8 index pages (the scoring kernel's e4m3 x
    e4m3 path; the fused selection has none). ``q_pos`` int32 [B, Q]: the new tokens' positions, which must
    be ``seq_lens - Q + t`` (the kernels' causal limits), when the caller has them: deriving them from
    ``seq_lens`` again is one more XLA launch per step.
    Returns (o [B, Q, N, H], block ids int32 [B, K, Q, topk])."""
    # fp8 index pages (index_cache_dtype) go in as stored: the kernel converts each page in SMEM
    # (exact), or multiplies it as it is under the fp8 indexer, so the scan reads one byte per key element.
    kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
              force_in=force_in, force_out=force_out)
    if fused_select and score_dtype != "bfloat16":
        raise ValueError(f"decode_pages: the fused selection has no score_dtype={score_dtype!r} path")
    if fused_select:
        sel = decode_select_blocks(iq, ik_pages, page_table, seq_lens, **kw)
    else:
        sel = decode_score_select(iq, ik_pages, page_table, seq_lens, q_pos, score_dtype=score_dtype, **kw)
    return sparse_decode_attention(q, k_pages, v_pages, page_table, sel, seq_lens, block_size=block_size), sel


def decode(q, iq, kv: LayerCache, page_table: jax.Array, q_pos: jax.Array, cfg: TextConfig,
           force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = ()):
    """One decode token per sequence through the paged decode kernels (:func:`decode_pages`): the index
    keys and the selected K/V pages are read in place, the cache is never gathered. ``force_in`` /
    ``force_out`` as in :func:`prefill`. ``msa_decode_select="fused"`` takes the fused selection unless
    its canary failed on this GPU at this block size (then the scoring and top-k kernels, with a
    warning) or under the fp8 indexer (no e4m3 product there; the scoring and top-k kernels select the
    same ids). Returns (o, block ids)."""
    if reason := _decode_score_dtype_reason(cfg):
        raise UnsupportedConfigError(f"MSA decode kernels: {reason}")
    fused = _fused_select(cfg) and not verdicts.kernel_failure("decode_select_fused", block_size=cfg.index_block_size)
    return decode_pages(q, iq, kv.k, kv.v, kv.ik, page_table, q_pos[:, -1] + 1, block_size=cfg.index_block_size,
                        topk=cfg.index_topk_blocks, local_blocks=cfg.index_local_blocks,
                        init_blocks=cfg.index_init_blocks, force_in=force_in, force_out=force_out,
                        fused_select=fused, score_dtype=cfg.index_score_dtype, q_pos=q_pos)


def dense_decode(q, kv: LayerCache, page_table: jax.Array, q_pos: jax.Array, cfg: TextConfig) -> jax.Array:
    """Full causal attention of one decode token per sequence (the full-attention layers), reading the
    K/V pages in place: the paged decode attention kernel with every block up to the token's own
    selected, so the cache is never gathered into a contiguous copy. Returns o [B, 1, N, H]."""
    bs = cfg.index_block_size
    blocks = jnp.arange(page_table.shape[1], dtype=jnp.int32)[None]
    sel = jnp.where(blocks <= q_pos[:, -1:] // bs, blocks, -1)  # [B, max_pages], -1: in the future
    sel = jnp.broadcast_to(sel[:, None, None], (q.shape[0], kv.k.shape[2], 1, blocks.shape[1]))
    return sparse_decode_attention(q, kv.k, kv.v, page_table, sel, q_pos[:, -1] + 1, block_size=bs)


def local_prefill(cfg: TextConfig) -> Local:
    """Per-device pieces of context-parallel MSA prefill (:func:`m3jax.msa.parallel.context_parallel`):
    the device's pages gathered into a contiguous window, the index-score kernel with the local causal
    length, the KV-major sparse attention kernel with its LSE. Both kernels take the whole chunk."""
    bs = cfg.index_block_size

    def scores(iq, keys, local_len):
        # fp8 index pages (index_cache_dtype) are upcast (exact), as the single-device path does
        return index_block_scores(iq, keys[2].astype(iq.dtype), local_len - 1, block_size=bs, **_score_args(cfg))

    def attend(q, keys, local_sel, local_len):
        return sparse_attention(q, keys[0], keys[1], local_sel, jnp.maximum(local_len - 1, 0), block_size=bs,
                                implementation="kv_major", return_lse=True)

    return Local(keys=local_window, scores=scores, attend=attend)


def _paged_keys(k_pages, v_pages, ik_pages, local_pages):
    """The decode kernels read the pages in place through the local page table."""
    return k_pages, v_pages, ik_pages, local_pages


def _paged_attend(bs: int):
    def attend(q, keys, local_sel, local_len):
        k, v, _, pages = keys
        return sparse_decode_attention(q, k, v, pages, local_sel, local_len[:, -1], block_size=bs, return_lse=True)

    return attend


def local_decode(cfg: TextConfig) -> Local:
    """Per-device pieces of context-parallel MSA decode: both paged decode kernels on the device's own
    pages, in place (its local page table and length). fp8 index pages go in as stored: the kernel
    converts them in SMEM."""
    bs = cfg.index_block_size

    def scores(iq, keys, local_len):
        return decode_index_scores(iq, keys[2], keys[3], local_len[:, -1], block_size=bs,
                                   score_dtype=cfg.index_score_dtype)

    return Local(keys=_paged_keys, scores=scores, attend=_paged_attend(bs))


def local_dense_decode(cfg: TextConfig) -> Local:
    """Per-device pieces of a full-attention layer's context-parallel decode: the paged decode attention
    kernel over every visible block the device holds (no selection)."""
    return Local(keys=_paged_keys, scores=None, attend=_paged_attend(cfg.index_block_size))
