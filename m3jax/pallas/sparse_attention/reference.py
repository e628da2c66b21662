"""Pure-jnp reference for MSA block-sparse prefill attention (same signature as the kernels).

The output is exactly :func:`m3jax.msa.sparse_attention` (fp32 softmax, scale 1/sqrt(H), causal mask
on the own block). ``return_lse`` adds the natural-log LSE [B, T, N] over the visible selected keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax import msa


def sparse_attention(q, k, v, block_idx, q_pos, *, block_size: int, config=None, return_lse: bool = False):
    del config
    out = msa.sparse_attention(q, k, v, block_idx, q_pos, block_size)
    if not return_lse:
        return out
    return out, sparse_lse(q, k, block_idx, q_pos, block_size=block_size)


def sparse_lse(q, k, block_idx, q_pos, *, block_size: int):
    """LSE [B, T, N] (fp32, natural log) of the scaled logits over each query's visible selected keys."""
    b, c, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    nb = -(-s_len // block_size)
    kb = jnp.pad(k, [(0, 0), (0, nb * block_size - s_len), (0, 0), (0, 0)])
    kb = jnp.moveaxis(kb.reshape(b, nb, block_size, kh, h), 3, 1)
    bi = jnp.arange(b)[:, None, None, None]
    gi = jnp.arange(kh)[None, :, None, None]
    kg = kb[bi, gi, jnp.maximum(block_idx, 0)]  # [B, K, C, topk, bs, H]
    qg = q.reshape(b, c, kh, g, h).astype(jnp.float32)
    logits = jnp.einsum("bckgh,bkctsh->bkgcts", qg, kg.astype(jnp.float32), precision=msa.HIGHEST) * (h**-0.5)
    kpos = block_idx[..., None] * block_size + jnp.arange(block_size)
    ok = (block_idx[..., None] >= 0) & (kpos <= q_pos[:, None, :, None, None])
    logits = jnp.where(ok[:, :, None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits.reshape(*logits.shape[:4], -1), axis=-1)  # [B, K, G, C]
    return jnp.moveaxis(lse, 3, 1).reshape(b, c, n)
