"""The MSA indexer objective's target on a Mosaic GPU kernel: causal attention mass per (query, KV
group, key block), averaged over the group's heads, flash-style (see :mod:`.kernel` for the design),
and its pure-jnp reference. Forward only: the target is ``stop_gradient``'d."""

from __future__ import annotations

from m3jax.pallas._common import check_dims

from . import kernel, reference
from .kernel import BlockMassConfig, unsupported_reason

IMPLEMENTATIONS = ("kernel", "reference")


def block_mass(q, k, q_pos, *, block_size: int, num_blocks: int, implementation: str = "kernel",
               config: BlockMassConfig | None = None):
    """Causal attention mass per key block, averaged over each KV group's heads.

    Args:
      q: [B, T, N, H]; k: [B, S, K, H] (key s at position s); q_pos: int32 [B, T] absolute query
        positions (a chunk of a longer prefill: any offset, keys up to S).
      num_blocks: nb >= ceil(S / block_size).
      implementation: "kernel" (Hopper; :func:`unsupported_reason` says where it cannot run) or
        "reference".
    Returns:
      fp32 [B, K, T, nb], :func:`m3jax.msa.reference.causal_block_mass`. No gradient (forward only).
    """
    dims = check_dims("block_mass", q=(q, "B T N H"), k=(k, "B S K H"), q_pos=(q_pos, "B T"))
    if dims["N"] % dims["K"]:
        raise ValueError(f"block_mass: query heads N={dims['N']} must be a multiple of the KV heads K={dims['K']}")
    if num_blocks * block_size < dims["S"]:
        raise ValueError(f"block_mass: num_blocks={num_blocks} blocks of {block_size} do not cover S={dims['S']} keys")
    if implementation == "reference":
        return reference.block_mass(q, k, q_pos, block_size=block_size, num_blocks=num_blocks)
    if implementation != "kernel":
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return kernel.block_mass(q, k, q_pos, block_size=block_size, num_blocks=num_blocks, config=config)


__all__ = ["block_mass", "BlockMassConfig", "unsupported_reason", "IMPLEMENTATIONS", "kernel", "reference"]
