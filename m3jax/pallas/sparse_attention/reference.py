"""Pure-jnp reference for MSA block-sparse prefill attention (same signature as the kernels).

The output is exactly :func:`m3jax.msa.sparse_attention` (fp32 softmax, scale 1/sqrt(H), causal mask
on the own block). ``return_lse`` adds the natural-log LSE [B, T, N] over the visible selected keys.
:func:`sparse_attention_vjp` is its gradient, what the backward kernel is tested against.
"""

from __future__ import annotations

import jax

from m3jax.msa import reference as msa


def sparse_attention(q, k, v, block_idx, q_pos, *, block_size: int, config=None, return_lse: bool = False):
    del config
    return msa.sparse_attention(q, k, v, block_idx, q_pos, block_size, return_lse=return_lse)



def sparse_attention_vjp(q, k, v, block_idx, q_pos, do, dlse=None, *, block_size: int):
    """(dq, dk, dv) of :func:`sparse_attention` for the output cotangent ``do`` (and the LSE's ``dlse``,
    when given): ``jax.vjp`` of the reference. block_idx and q_pos get none (the selection is discrete)."""
    if dlse is None:
        _, vjp = jax.vjp(lambda q_, k_, v_: sparse_attention(q_, k_, v_, block_idx, q_pos, block_size=block_size),
                         q, k, v)
        return vjp(do)
    _, vjp = jax.vjp(lambda q_, k_, v_: sparse_attention(q_, k_, v_, block_idx, q_pos, block_size=block_size,
                                                         return_lse=True), q, k, v)
    return vjp((do, dlse))
