"""MSA top-k block selection (MSA.md §1.3, §2.3): Mosaic GPU kernel + pure-jnp reference.

``select_blocks(scores, q_pos, *, block_size, topk, local_blocks=1, init_blocks=0,
implementation="pallas", config=None)`` -> int32 ``[B, Hi, T, topk]``. The kernel emits the
reference order (forced own/local/sink blocks first, then descending score with ties to the lower
block id, then ``-1``); ``select_blocks_blockmajor`` takes the index-score kernel's block-major
``[B, nb, T*Hi]`` scores directly (no transpose).
"""

from __future__ import annotations

from m3jax.pallas.topk import kernel as _kernel
from m3jax.pallas.topk import reference as _reference
from m3jax.pallas.topk.kernel import TopkConfig, select_blocks_blockmajor

__all__ = ["TopkConfig", "select_blocks", "select_blocks_blockmajor"]


def select_blocks(scores, q_pos, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0,
                  implementation: str = "pallas", config=None):
    kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks, config=config)
    if implementation == "pallas":
        return _kernel.select_blocks(scores, q_pos, **kw)
    if implementation == "reference":
        return _reference.select_blocks(scores, q_pos, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")
