"""Pure-jnp reference for the MSA index block scores (fp32 accumulation); same signature as the kernel."""

from __future__ import annotations

import jax

from m3jax.msa import reference as msa


def index_block_scores(iq, ik, q_pos, *, block_size: int, config=None, score_dtype: str = "bfloat16",
                       keys_fp8: bool = False) -> jax.Array:
    """fp32 [B, Hi, T, nb]: max over the block's tokens s <= q_pos of iq . ik (in ``score_dtype``:
    ``msa.block_scores``), -inf for future blocks."""
    del config
    return msa.block_scores(iq, ik, q_pos, block_size, score_dtype=score_dtype, keys_fp8=keys_fp8)


def index_select_blocks(iq, ik, q_pos, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0,
                        force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = (), config=None,
                        score_dtype: str = "bfloat16", keys_fp8: bool = False) -> jax.Array:
    """Scores then top-k: int32 [B, Hi, T, topk] (``msa.select_blocks`` order)."""
    del config
    scores = msa.block_scores(iq, ik, q_pos, block_size, score_dtype=score_dtype, keys_fp8=keys_fp8)
    return msa.select_blocks(scores, q_pos, block_size=block_size, topk=topk, local_blocks=local_blocks,
                             init_blocks=init_blocks, force_in=force_in, force_out=force_out)
