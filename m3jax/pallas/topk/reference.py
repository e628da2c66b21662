"""Pure-jnp reference for MSA top-k block selection (``jax.lax.top_k``); same signature as the kernel."""

from __future__ import annotations

import jax

from m3jax.msa import reference as msa


def select_blocks(scores, q_pos, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0,
                  force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = (), config=None) -> jax.Array:
    """int32 [B, Hi, T, topk]: forced blocks first, then descending score (ties to the lower id), -1 padding."""
    del config
    return msa.select_blocks(scores, q_pos, block_size=block_size, topk=topk, local_blocks=local_blocks,
                             init_blocks=init_blocks, force_in=force_in, force_out=force_out)
