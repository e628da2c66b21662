"""Pure-jnp reference for MSA block-sparse prefill attention (same signature as the kernels).

The output is exactly :func:`m3jax.msa.sparse_attention` (fp32 softmax, scale 1/sqrt(H), causal mask
on the own block). ``return_lse`` adds the natural-log LSE [B, T, N] over the visible selected keys.
"""

from __future__ import annotations

from m3jax.msa import reference as msa


def sparse_attention(q, k, v, block_idx, q_pos, *, block_size: int, config=None, return_lse: bool = False):
    del config
    return msa.sparse_attention(q, k, v, block_idx, q_pos, block_size, return_lse=return_lse)

