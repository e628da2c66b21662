"""Pure-jnp reference of the block-mass kernel (same signature): :func:`m3jax.msa.reference.causal_block_mass`,
the one jnp computation of the indexer objective's target."""

from __future__ import annotations

from m3jax.msa import reference as msa


def block_mass(q, k, q_pos, *, block_size: int, num_blocks: int, config=None):
    del config
    return msa.causal_block_mass(q, k, q_pos, block_size, num_blocks)
