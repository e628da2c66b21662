"""MSA decode: paged index-block scoring, top-k (:mod:`m3jax.pallas.topk`) and sparse paged attention.

``implementation="pallas"`` runs the Mosaic GPU kernels of :mod:`.kernel` and the top-k kernel
(GPU interpret mode off-GPU); ``"reference"`` the pure-jnp versions of :mod:`.reference` (gather
pages + :mod:`m3jax.msa`).
"""

from __future__ import annotations

import jax

from m3jax.pallas import topk as _topk
from m3jax.pallas._backend import current_target
from m3jax.pallas.decode import blackwell as _blackwell
from m3jax.pallas.decode import kernel as _kernel
from m3jax.pallas.decode import reference as _reference
from m3jax.pallas.decode.kernel import IndexScoreConfig, SparseDecodeConfig, union_pages  # noqa: F401
from m3jax.pallas.decode.reference import query_positions

__all__ = [
    "IndexScoreConfig",
    "SparseDecodeConfig",
    "decode_index_scores",
    "sparse_decode_attention",
    "msa_decode",
    "query_positions",
]


def decode_index_scores(
    iq, ik_pages, page_table, seq_lens, *, block_size: int, implementation: str = "pallas",
    config: IndexScoreConfig = IndexScoreConfig(), interpret: bool | None = None,
) -> jax.Array:
    """fp32 [B, Hi, Q, max_pages] block-max index scores (see :func:`.kernel.decode_index_scores_kernel`)."""
    if implementation == "reference":
        return _reference.decode_index_scores(iq, ik_pages, page_table, seq_lens, block_size=block_size)
    if implementation != "pallas":
        raise ValueError(f"unknown implementation {implementation!r}")
    kernel = _kernel.decode_index_scores_kernel
    if current_target().mma == "tcgen05":  # Blackwell: tcgen05 MMAs into TMEM (.blackwell)
        kernel = _blackwell.decode_index_scores_tcgen05
    return kernel(iq, ik_pages, page_table, seq_lens, block_size=block_size, config=config, interpret=interpret)


def sparse_decode_attention(
    q, k_pages, v_pages, page_table, block_idx, seq_lens, *, block_size: int,
    implementation: str = "pallas", config: SparseDecodeConfig = SparseDecodeConfig(),
    interpret: bool | None = None, return_lse: bool = False,
):
    """[B, Q, N, H] attention over the selected pages (see :func:`.kernel.sparse_decode_attention_kernel`),
    and with ``return_lse`` its natural-log LSE fp32 [B, Q, N] (for merging partials across devices)."""
    if implementation == "reference":
        return _reference.sparse_decode_attention(
            q, k_pages, v_pages, page_table, block_idx, seq_lens, block_size=block_size, return_lse=return_lse
        )
    if implementation != "pallas":
        raise ValueError(f"unknown implementation {implementation!r}")
    kernel = _kernel.sparse_decode_attention_kernel
    if current_target().mma == "tcgen05":  # Blackwell: tcgen05 MMAs into TMEM (.blackwell)
        kernel = _blackwell.sparse_decode_attention_tcgen05
    return kernel(q, k_pages, v_pages, page_table, block_idx, seq_lens, block_size=block_size, config=config,
                  interpret=interpret, return_lse=return_lse)


def msa_decode(
    q, iq, k_pages, v_pages, ik_pages, page_table, seq_lens, *, block_size: int, topk: int,
    local_blocks: int = 1, init_blocks: int = 0, implementation: str = "pallas",
) -> jax.Array:
    """One MSA decode step of one layer: index scores -> top-k blocks -> sparse paged attention.

    q [B, Q, N, H], iq [B, Q, Hi, Hx] (Hi == K), caches as in the kernels; returns [B, Q, N, H].
    """
    scores = decode_index_scores(
        iq, ik_pages, page_table, seq_lens, block_size=block_size, implementation=implementation
    )
    q_pos = query_positions(seq_lens, q.shape[1])
    block_idx = _topk.select_blocks(
        scores, q_pos, block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
        implementation=implementation,
    )
    return sparse_decode_attention(
        q, k_pages, v_pages, page_table, block_idx, seq_lens, block_size=block_size,
        implementation=implementation,
    )
