"""MSA decode kernels: paged index-block scoring and sparse paged attention (composed with the top-k
kernel of :mod:`m3jax.pallas.topk` in :func:`m3jax.msa.kernels.decode_pages`), and the fused paged
selection (:func:`decode_select_blocks`: scores, block max and per-split top-k in one launch; Hopper
only, on tcgen05 targets it runs the scoring kernel and the top-k kernel instead).

The fp8 indexer (``score_dtype="float8_e4m3fn"``) reads fp8 index pages in place on Hopper (an
e4m3 x e4m3 wgmma per page, :func:`.hopper.decode_index_scores`); :func:`fp8_scores_unsupported_reason`
says where it cannot.

``implementation="pallas"`` runs the Mosaic GPU kernels of the target's :mod:`.hopper` or :mod:`.blackwell`
(over :mod:`.kernel`'s shared plan and launch) and the top-k kernel
(GPU interpret mode off-GPU); ``"reference"`` the pure-jnp versions of :mod:`.reference` (gather
pages + :mod:`m3jax.msa`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3jax.pallas import topk as _topk
from m3jax.pallas._backend import arch_module
from m3jax.pallas._common import check_dims
from m3jax.pallas.decode import blackwell as _blackwell
from m3jax.pallas.decode import hopper as _hopper
from m3jax.pallas.decode import reference as _reference
from m3jax.pallas.decode.kernel import FP8, FP8_SCORES, DecodeScoreConfig, SparseDecodeConfig
from m3jax.pallas.decode.reference import query_positions

__all__ = [
    "DecodeScoreConfig",
    "SparseDecodeConfig",
    "decode_index_scores",
    "decode_score_select",
    "decode_select_blocks",
    "sparse_decode_attention",
    "query_positions",
    "fp8_scores_unsupported_reason",
]


def _check_block_size(where: str, name: str, pages, block_size: int) -> None:
    if pages.shape[1] != block_size:
        raise ValueError(f"{where}: {name} holds pages of {pages.shape[1]} tokens (dimension 1 of {pages.shape}), "
                         f"but block_size={block_size}")


def fp8_scores_unsupported_reason(ik_dtype) -> str | None:
    """Why the decode scoring kernel cannot run the fp8 indexer over ``ik_dtype`` pages on this target
    (None when it can)."""
    if jnp.dtype(ik_dtype) != FP8:
        return (f"the fp8 indexer's decode scoring reads fp8 index pages as stored (index_cache_dtype="
                f"'float8_e4m3fn'), not {jnp.dtype(ik_dtype).name} pages (whose keys it would quantise every step)")
    if arch_module(_hopper, _blackwell) is _blackwell:
        return "the tcgen05 decode scoring kernel has no e4m3 x e4m3 path (Hopper's wgmma one only)"
    return None


def decode_index_scores(
    iq, ik_pages, page_table, seq_lens, *, block_size: int, implementation: str = "pallas",
    config: DecodeScoreConfig = DecodeScoreConfig(), score_dtype: str = "bfloat16", interpret: bool | None = None,
) -> jax.Array:
    """fp32 [B, Hi, Q, max_pages] block-max index scores (see :func:`.hopper.decode_index_scores`);
    ``score_dtype="float8_e4m3fn"``: the fp8 indexer over fp8 pages (keys as stored, as
    ``m3jax.msa.reference.block_scores(..., keys_fp8=True)``)."""
    check_dims("decode_index_scores", iq=(iq, "B Q Hi Hx"), ik_pages=(ik_pages, "pages block_size Hx"),
               page_table=(page_table, "B max_pages"), seq_lens=(seq_lens, "B"))
    _check_block_size("decode_index_scores", "ik_pages", ik_pages, block_size)
    _check_score_dtype("decode_index_scores", score_dtype)
    if implementation == "reference":
        return _reference.decode_index_scores(iq, ik_pages, page_table, seq_lens, block_size=block_size,
                                              score_dtype=score_dtype)
    if implementation != "pallas":
        raise ValueError(f"unknown implementation {implementation!r}")
    kernel = _score_kernel("decode_index_scores", ik_pages.dtype, score_dtype, rows=False)
    return kernel(iq, ik_pages, page_table, seq_lens, block_size=block_size, config=config, interpret=interpret)


def decode_score_select(
    iq, ik_pages, page_table, seq_lens, q_pos=None, *, block_size: int, topk: int, local_blocks: int = 1,
    init_blocks: int = 0, force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = (),
    implementation: str = "pallas", config: DecodeScoreConfig = DecodeScoreConfig(), score_dtype: str = "bfloat16",
    interpret: bool | None = None,
) -> jax.Array:
    """int32 [B, Hi, Q, topk] block ids of the Q new tokens: :func:`decode_index_scores` then
    :func:`m3jax.pallas.topk.select_blocks`, with the row-split top-k kernel reading the scoring
    kernel's rows in place (:func:`m3jax.pallas.topk.rowsplit.select_blocks_rows`: its mask of the
    unwritten blocks and the rows' factors applied as it loads them), so the two kernels launch
    back to back with no XLA transpose between them. Where the row-split kernel cannot take the rows
    (more than ``topk.ROWSPLIT_MAX_ROWS``, or too many blocks for one CTA), the scores are laid out
    as :func:`decode_index_scores` gives them for the block-major top-k. ``q_pos`` int32 [B, Q]: the
    tokens' positions, ``seq_lens - Q + t`` (derived from ``seq_lens`` when None)."""
    kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
              force_in=tuple(force_in), force_out=tuple(force_out))
    pos = query_positions(seq_lens, iq.shape[1]) if q_pos is None else q_pos
    score_kw = dict(block_size=block_size, config=config, interpret=interpret)
    b, q, hi, _ = iq.shape
    if implementation != "pallas" or not _topk.takes_rowsplit(b * hi * q, page_table.shape[1], topk):
        scores = decode_index_scores(iq, ik_pages, page_table, seq_lens, implementation=implementation,
                                     score_dtype=score_dtype, **score_kw)
        return _topk.select_blocks(scores, pos, implementation="pallas" if implementation == "pallas" else
                                   "reference", **kw)
    check_dims("decode_score_select", iq=(iq, "B Q Hi Hx"), ik_pages=(ik_pages, "pages block_size Hx"),
               page_table=(page_table, "B max_pages"), seq_lens=(seq_lens, "B"), q_pos=(pos, "B Q"))
    _check_block_size("decode_score_select", "ik_pages", ik_pages, block_size)
    _check_score_dtype("decode_score_select", score_dtype)
    kernel = _score_kernel("decode_score_select", ik_pages.dtype, score_dtype, rows=True)
    score_rows, unscale = kernel(iq, ik_pages, page_table, seq_lens, **score_kw)
    return _topk.select_blocks_rows(score_rows, pos, unscale, heads=hi, num_blocks=page_table.shape[1],
                                    interpret=interpret, **kw)


def _check_score_dtype(where: str, score_dtype: str) -> None:
    if score_dtype not in ("bfloat16", FP8_SCORES):
        raise ValueError(f"{where}: score_dtype={score_dtype!r}; choose 'bfloat16' or {FP8_SCORES!r}")


def _score_kernel(where: str, ik_dtype, score_dtype: str, *, rows: bool):
    """The target's scoring kernel with ``score_dtype`` (already checked by :func:`_check_score_dtype`)
    bound (the fp8 indexer: Hopper's, checked here): ``rows`` its raw rows and factors, else the
    [B, Hi, Q, pages] scores."""
    if score_dtype == FP8_SCORES and (reason := fp8_scores_unsupported_reason(ik_dtype)):
        raise ValueError(f"{where}: {reason}")
    arch = arch_module(_hopper, _blackwell)
    kernel = arch.decode_index_score_rows if rows else arch.decode_index_scores
    # Blackwell's kernels take no score_dtype: only bf16 reaches them (fp8_scores_unsupported_reason).
    return functools.partial(kernel, score_dtype=score_dtype) if arch is _hopper else kernel


def decode_select_blocks(
    iq, ik_pages, page_table, seq_lens, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0,
    force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = (), implementation: str = "pallas",
    config: DecodeScoreConfig = DecodeScoreConfig(), interpret: bool | None = None,
) -> jax.Array:
    """int32 [B, Hi, Q, topk] block ids of the Q new tokens (see :func:`.hopper.decode_select_blocks`):
    what :func:`decode_index_scores` then :func:`m3jax.pallas.topk.select_blocks` give, from one scan
    of the pages (the fused kernel's per-split lists, merged by the top-k kernel)."""
    check_dims("decode_select_blocks", iq=(iq, "B Q Hi Hx"), ik_pages=(ik_pages, "pages block_size Hx"),
               page_table=(page_table, "B max_pages"), seq_lens=(seq_lens, "B"))
    _check_block_size("decode_select_blocks", "ik_pages", ik_pages, block_size)
    kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
              force_in=tuple(force_in), force_out=tuple(force_out))
    if implementation == "reference":
        return _reference.decode_select_blocks(iq, ik_pages, page_table, seq_lens, **kw)
    if implementation != "pallas":
        raise ValueError(f"unknown implementation {implementation!r}")
    if arch_module(_hopper, _blackwell) is _blackwell:
        # No tcgen05 port of the fused selection yet: the scoring kernel, then the top-k kernel.
        return decode_score_select(iq, ik_pages, page_table, seq_lens, config=config, interpret=interpret, **kw)
    return _hopper.decode_select_blocks(iq, ik_pages, page_table, seq_lens, config=config, interpret=interpret, **kw)


def sparse_decode_attention(
    q, k_pages, v_pages, page_table, block_idx, seq_lens, *, block_size: int,
    implementation: str = "pallas", config: SparseDecodeConfig = SparseDecodeConfig(),
    interpret: bool | None = None, return_lse: bool = False,
):
    """[B, Q, N, H] attention over the selected pages (see :func:`.hopper.sparse_decode_attention`),
    and with ``return_lse`` its natural-log LSE fp32 [B, Q, N] (for merging partials across devices)."""
    dims = check_dims("sparse_decode_attention", q=(q, "B Q N H"), k_pages=(k_pages, "pages block_size K H"),
                      v_pages=(v_pages, "pages block_size K H"), page_table=(page_table, "B max_pages"),
                      block_idx=(block_idx, "B K Q topk"), seq_lens=(seq_lens, "B"))
    _check_block_size("sparse_decode_attention", "k_pages", k_pages, block_size)
    if dims["N"] % dims["K"]:
        raise ValueError(f"sparse_decode_attention: query heads N={dims['N']} must be a multiple of the KV heads "
                         f"K={dims['K']}")
    if implementation == "reference":
        return _reference.sparse_decode_attention(
            q, k_pages, v_pages, page_table, block_idx, seq_lens, block_size=block_size, return_lse=return_lse
        )
    if implementation != "pallas":
        raise ValueError(f"unknown implementation {implementation!r}")
    kernel = arch_module(_hopper, _blackwell).sparse_decode_attention
    return kernel(q, k_pages, v_pages, page_table, block_idx, seq_lens, block_size=block_size, config=config,
                  interpret=interpret, return_lse=return_lse)
