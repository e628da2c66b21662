"""Hopper (sm_90a) tile maths of the prefill index-score kernel (:mod:`.kernel`): ``wgmma`` into a
register accumulator, masked and max-reduced in registers. Chosen by
:func:`m3jax.pallas._backend.arch_module`."""

from __future__ import annotations

import jax.numpy as jnp

from m3jax.pallas._backend import pl, plgpu
from m3jax.pallas._common import split_products
from m3jax.pallas.index_scores.tile import RowMax


def tile_rows(rows: int, block_size: int, fused: bool) -> int:
    """The row tile for ``rows`` asked: 64 where ``rows`` would not fit the fp32 accumulator registers
    (rows * block_size / 128 threads, + the top-k state if fused)."""
    if rows * block_size > (8192 if fused else 16384):
        return 64
    return rows


def row_max(n_parts: int, rows: int, bs: int) -> RowMax:
    """wgmma into a register accumulator [rows, bs], masked and reduced in registers."""

    def block_max(q_smems, k_smems, _, epilogue):
        def mma(acc_ref):
            # Smallest products first: they are summed before the large ones round the accumulator.
            for i, jp in reversed(split_products(n_parts)):
                plgpu.wgmma(acc_ref, q_smems[i], k_smems[jp].transpose((1, 0)))
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((rows, bs), jnp.float32))
        if epilogue is not None:
            acc = epilogue(acc, 0, plgpu.Layout.WGMMA)
        return acc.max(axis=1)

    return RowMax(plgpu.Layout.WGMMA.reduce(1), (), block_max)
