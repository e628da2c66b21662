"""MSA decode kernels: paged index-block scoring and sparse paged attention (composed with the top-k
kernel of :mod:`m3jax.pallas.topk` in :func:`m3jax.msa.kernels.decode_pages`).

``implementation="pallas"`` runs the Mosaic GPU kernels of :mod:`.kernel` and the top-k kernel
(GPU interpret mode off-GPU); ``"reference"`` the pure-jnp versions of :mod:`.reference` (gather
pages + :mod:`m3jax.msa`).
"""

from __future__ import annotations

import jax

from m3jax.pallas._backend import current_target
from m3jax.pallas._common import check_dims
from m3jax.pallas.decode import blackwell as _blackwell
from m3jax.pallas.decode import kernel as _kernel
from m3jax.pallas.decode import reference as _reference
from m3jax.pallas.decode.kernel import DecodeScoreConfig, SparseDecodeConfig
from m3jax.pallas.decode.reference import query_positions

__all__ = [
    "DecodeScoreConfig",
    "SparseDecodeConfig",
    "decode_index_scores",
    "sparse_decode_attention",
    "query_positions",
]


def _kernels():
    """(index-score kernel, attention kernel) of the current target, chosen here only: Blackwell's
    tcgen05 MMAs into TMEM (:mod:`.blackwell`) or Hopper's wgmma (:mod:`.kernel`), over one shared plan."""
    if current_target().mma == "tcgen05":
        return _blackwell.decode_index_scores_tcgen05, _blackwell.sparse_decode_attention_tcgen05
    return _kernel.decode_index_scores_kernel, _kernel.sparse_decode_attention_kernel


def _check_block_size(where: str, name: str, pages, block_size: int) -> None:
    if pages.shape[1] != block_size:
        raise ValueError(f"{where}: {name} holds pages of {pages.shape[1]} tokens (dimension 1 of {pages.shape}), "
                         f"but block_size={block_size}")


def decode_index_scores(
    iq, ik_pages, page_table, seq_lens, *, block_size: int, implementation: str = "pallas",
    config: DecodeScoreConfig = DecodeScoreConfig(), interpret: bool | None = None,
) -> jax.Array:
    """fp32 [B, Hi, Q, max_pages] block-max index scores (see :func:`.kernel.decode_index_scores_kernel`)."""
    check_dims("decode_index_scores", iq=(iq, "B Q Hi Hx"), ik_pages=(ik_pages, "pages block_size Hx"),
               page_table=(page_table, "B max_pages"), seq_lens=(seq_lens, "B"))
    _check_block_size("decode_index_scores", "ik_pages", ik_pages, block_size)
    if implementation == "reference":
        return _reference.decode_index_scores(iq, ik_pages, page_table, seq_lens, block_size=block_size)
    if implementation != "pallas":
        raise ValueError(f"unknown implementation {implementation!r}")
    return _kernels()[0](iq, ik_pages, page_table, seq_lens, block_size=block_size, config=config, interpret=interpret)


def sparse_decode_attention(
    q, k_pages, v_pages, page_table, block_idx, seq_lens, *, block_size: int,
    implementation: str = "pallas", config: SparseDecodeConfig = SparseDecodeConfig(),
    interpret: bool | None = None, return_lse: bool = False,
):
    """[B, Q, N, H] attention over the selected pages (see :func:`.kernel.sparse_decode_attention_kernel`),
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
    return _kernels()[1](q, k_pages, v_pages, page_table, block_idx, seq_lens, block_size=block_size, config=config,
                  interpret=interpret, return_lse=return_lse)
