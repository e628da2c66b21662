"""MSA block-sparse prefill attention: KV-block-major Mosaic GPU kernel + LSE combine, the query-major
baseline kernel, and the pure-jnp reference (see :mod:`.kernel` for the design)."""

from __future__ import annotations

import functools

import jax

from m3jax.pallas._common import check_dims

from . import csr, kernel, reference
from .kernel import SparseAttentionConfig

IMPLEMENTATIONS = ("kv_major", "query_major", "reference")


def sparse_attention(
    q, k, v, block_idx, q_pos, *, block_size: int, implementation: str = "kv_major",
    config: SparseAttentionConfig | None = None, return_lse: bool = False,
):
    """Block-sparse attention of each query over its KV group's selected blocks.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H] (key s at position s); block_idx: int32 [B, K, T, topk]
        (-1 = empty slot; valid ids in any order, each <= the query's own block, no duplicates);
        q_pos: int32 [B, T] absolute query positions.
      implementation: "kv_major" (default), "query_major" or "reference".
      return_lse: also return the fp32 natural-log LSE [B, T, N].
    Returns:
      [B, T, N, H] in q.dtype (and the LSE), semantics of :func:`m3jax.msa.sparse_attention`.
    """
    dims = check_dims("sparse_attention", q=(q, "B T N H"), k=(k, "B S K H"), v=(v, "B S K H"),
                      block_idx=(block_idx, "B K T topk"), q_pos=(q_pos, "B T"))
    if dims["N"] % dims["K"]:
        raise ValueError(f"sparse_attention: query heads N={dims['N']} must be a multiple of the KV heads K={dims['K']}")
    return _sparse_attention(
        q, k, v, block_idx, q_pos, block_size=block_size, implementation=implementation, config=config,
        return_lse=return_lse,
    )


@functools.partial(jax.jit, static_argnames=("block_size", "implementation", "config", "return_lse"))
def _sparse_attention(q, k, v, block_idx, q_pos, *, block_size, implementation, config, return_lse):
    # jitted so repeated calls with the same shapes reuse the compiled kernels (also in interpret mode)
    if implementation == "reference":
        return reference.sparse_attention(q, k, v, block_idx, q_pos, block_size=block_size, return_lse=return_lse)
    cfg = config or SparseAttentionConfig()
    if implementation == "kv_major":
        return kernel.kv_major_attention(q, k, v, block_idx, q_pos, block_size=block_size, cfg=cfg, return_lse=return_lse)
    if implementation == "query_major":
        return kernel.query_major_attention(
            q, k, v, block_idx, q_pos, block_size=block_size, cfg=cfg, return_lse=return_lse
        )
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


__all__ = ["sparse_attention", "SparseAttentionConfig", "IMPLEMENTATIONS", "csr", "kernel", "reference"]
