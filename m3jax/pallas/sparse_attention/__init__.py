"""MSA block-sparse prefill attention: KV-block-major Mosaic GPU kernel + LSE combine, the query-major
baseline kernel, and the pure-jnp reference (see :mod:`.kernel` for the design). The KV-major path is
differentiable in q, k, v (a custom VJP over the backward kernel of :mod:`.backward`)."""

from __future__ import annotations

import functools

import jax

from m3jax.pallas._common import check_dims

from . import backward, csr, kernel, reference
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

    Gradients: "kv_major" (through :func:`.backward.kv_major_backward`, or the reference gradient where
    :func:`.backward.unsupported_reason` says the backward kernel cannot run) and "reference" are
    differentiable w.r.t. q, k and v (and through the LSE); block_idx and q_pos get none.
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
        out, lse = _kv_major(q, k, v, block_idx, q_pos, block_size, cfg)
        return (out, lse) if return_lse else out
    if implementation == "query_major":
        return kernel.query_major_attention(
            q, k, v, block_idx, q_pos, block_size=block_size, cfg=cfg, return_lse=return_lse
        )
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _kv_major(q, k, v, block_idx, q_pos, block_size, cfg):
    return kernel.kv_major_attention(q, k, v, block_idx, q_pos, block_size=block_size, cfg=cfg, return_lse=True)


def _kv_major_fwd(q, k, v, block_idx, q_pos, block_size, cfg):
    out, lse = _kv_major(q, k, v, block_idx, q_pos, block_size, cfg)
    return (out, lse), (q, k, v, block_idx, q_pos, out, lse)


def _kv_major_bwd(block_size, cfg, res, cotangents):
    q, k, v, block_idx, q_pos, out, lse = res
    do, dlse = cotangents
    reason = backward.unsupported_reason(num_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3],
                                         block_size=block_size, dtype=kernel.compute_dtype(q, k, v), config=cfg)
    if reason is None:
        dq, dk, dv = backward.kv_major_backward(q, k, v, block_idx, q_pos, out, lse, do, dlse, block_size=block_size,
                                                cfg=cfg)
    else:  # the named fallback (docs/KERNELS.md §2.9): correct, not fast
        dq, dk, dv = reference.sparse_attention_vjp(q, k, v, block_idx, q_pos, do, dlse, block_size=block_size)
    return dq, dk, dv, None, None


_kv_major.defvjp(_kv_major_fwd, _kv_major_bwd)

__all__ = ["sparse_attention", "SparseAttentionConfig", "IMPLEMENTATIONS", "backward", "csr", "kernel", "reference"]
