"""Blackwell (sm_100a) tile maths of the pipelined grouped GEMM (:mod:`.kernel`): each K step's
``tcgen05_mma`` into a TMEM accumulator, asynchronous. Chosen by
:func:`m3jax.pallas._backend.arch_module`; the schedule, the pipeline and the masked store are
:mod:`.kernel`'s.

Step kk's MMA is committed to barrier kk % 2 and step kk waits for step kk - delay's, whose buffers
the pipeline refills after it (two barriers: one may not be arrived on twice without a wait between).
The same wait frees, for MXFP8, the bf16 buffer that step kk + 1 dequantises into. The accumulator is
read back with ``async_load_tmem`` for the store.
"""

from __future__ import annotations

import jax.numpy as jnp

from m3jax.pallas._backend import pl, plgpu


def tile_reason(block_m: int, block_n: int) -> str | None:
    """Why tcgen05 cannot take a ``block_m x block_n`` tile beyond :func:`.kernel.unsupported_reason`'s
    shared limits (None when it can)."""
    if block_m == 64 and block_n < 128:
        # a 64-row tcgen05 MMA splits N over two lane groups, each at least one 128-byte swizzle wide
        return f"block_n={block_n} must be >= 128 with block_m=64 on tcgen05"
    return None


def accumulate(pipeline, n_steps: int, weights, *, bm: int, bn: int, delay: int, w_smem=None):
    """fp32 [bm, bn] as :func:`.hopper.accumulate`, in TMEM (module docstring)."""

    def mma(acc_tmem, mma_bar):
        def step(idx, a_smem, b_smem, s_smem=None):
            (kk,) = idx
            plgpu.tcgen05_mma(acc_tmem, a_smem, weights(kk, b_smem, s_smem, w_smem), accumulate=kk > 0)
            plgpu.tcgen05_commit_arrive(mma_bar.at[kk % 2])
            pl.when(kk >= delay)(lambda: plgpu.barrier_wait(mma_bar.at[(kk - delay) % 2]))

        pipeline(step)
        if delay:
            plgpu.barrier_wait(mma_bar.at[(n_steps - 1) % 2])  # the last step's MMA
        acc = plgpu.async_load_tmem(acc_tmem)
        plgpu.wait_load_tmem()  # before the scope frees the TMEM
        return acc

    return pl.run_scoped(mma, plgpu.TMEM((bm, bn), jnp.float32),
                         plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True))
