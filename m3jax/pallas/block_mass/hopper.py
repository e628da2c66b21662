"""Hopper (sm_90a) tile maths of the block-mass kernel (:mod:`.kernel`): one head's scores S = Q K^T
for one key block on ``wgmma`` into a register accumulator, and the register layouts the kernel's
masks and row vectors use."""

from __future__ import annotations

import jax.numpy as jnp

from m3jax.pallas._backend import pl, plgpu
from m3jax.pallas._common import split_products

LAYOUT = plgpu.Layout.WGMMA
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)


def scores(q_parts, k_parts, shape):
    """fp32 [rows, bs] = Q K^T summed over the split pieces' products (:func:`split_products`)."""
    def mma(acc_ref):
        # Smallest products first: they are summed before the large ones round the accumulator.
        for a, c in reversed(split_products(len(q_parts))):
            plgpu.wgmma(acc_ref, q_parts[a], k_parts[c].transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))
