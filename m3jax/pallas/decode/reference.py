"""Pure-jnp references of the MSA decode kernels: gather the pages, then call :mod:`m3jax.msa`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax.msa import reference as msa


def query_positions(seq_lens: jax.Array, q: int) -> jax.Array:
    """int32 [B, Q]: query i of Q sits at ``seq_lens[b] - Q + i``."""
    return seq_lens.astype(jnp.int32)[:, None] - q + jnp.arange(q, dtype=jnp.int32)[None, :]


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[num_pages, bs, ...] + [B, max_pages] -> [B, max_pages * bs, ...] (logical token order)."""
    g = pages[page_table]  # [B, max_pages, bs, ...]
    return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])


def decode_index_scores(iq, ik_pages, page_table, seq_lens, *, block_size: int, score_dtype: str = "bfloat16",
                        **_unused) -> jax.Array:
    """fp32 [B, Hi, Q, max_pages]; iq [B, Q, Hi, Hx], ik_pages [num_pages, block_size, Hx]; the fp8
    indexer (``score_dtype``) takes fp8 pages' keys as stored (``keys_fp8``), as the model's reference does."""
    ik = gather_pages(ik_pages, page_table)
    return msa.block_scores(iq, ik, query_positions(seq_lens, iq.shape[1]), block_size, score_dtype=score_dtype,
                            keys_fp8=ik_pages.dtype == msa.FP8)


def sparse_decode_attention(
    q, k_pages, v_pages, page_table, block_idx, seq_lens, *, block_size: int, return_lse: bool = False, **_unused
):
    """[B, Q, N, H]; rows whose query position is < 0 (padding) give 0 (and, with ``return_lse``, the
    natural-log LSE fp32 [B, Q, N], -inf for rows without a visible key)."""
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    q_pos = query_positions(seq_lens, q.shape[1])
    out, lse = msa.sparse_attention(q, k, v, block_idx, q_pos, block_size, return_lse=True)
    real = (q_pos >= 0)[:, :, None]
    out = jnp.where(real[..., None], out, 0).astype(q.dtype)
    return (out, jnp.where(real, lse, -jnp.inf)) if return_lse else out


def decode_select_blocks(iq, ik_pages, page_table, seq_lens, *, block_size: int, topk: int, local_blocks: int = 1,
                         init_blocks: int = 0, force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = (),
                         **_unused) -> jax.Array:
    """int32 [B, Hi, Q, topk]: :func:`decode_index_scores` then :func:`m3jax.msa.reference.select_blocks`."""
    scores = decode_index_scores(iq, ik_pages, page_table, seq_lens, block_size=block_size)
    return msa.select_blocks(scores, query_positions(seq_lens, iq.shape[1]), block_size=block_size, topk=topk,
                             local_blocks=local_blocks, init_blocks=init_blocks, force_in=tuple(force_in),
                             force_out=tuple(force_out))
