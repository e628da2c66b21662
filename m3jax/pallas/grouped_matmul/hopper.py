"""Hopper (sm_90a) tile maths of the pipelined grouped GEMM (:mod:`.kernel`): each K step's ``wgmma``
into a register accumulator. Chosen by :func:`m3jax.pallas._backend.arch_module`; the schedule, the
pipeline and the masked store are :mod:`.kernel`'s."""

from __future__ import annotations

import jax.numpy as jnp

from m3jax.pallas._backend import pl, plgpu


def tile_reason(block_m: int, block_n: int) -> str | None:
    """Why wgmma cannot take a ``block_m x block_n`` tile beyond :func:`.kernel.unsupported_reason`'s
    shared limits: none."""
    return None


def accumulate(pipeline, n_steps: int, weights, *, bm: int, bn: int, delay: int, w_smem=None):
    """fp32 [bm, bn] = the sum over the K steps that ``pipeline(step)`` runs of the lhs tile times
    ``weights(kk, b_smem, s_smem, w_smem)``. ``wgmma_wait(delay)`` after issuing step kk's MMA retires
    step kk - 1's: its lhs / weight buffers (``delay_release``) and, for MXFP8, the bf16 buffer step
    kk + 1 dequantises into. ``n_steps``: the K steps (unused here: each step waits for its own)."""

    def mma(acc_ref):
        def step(idx, a_smem, b_smem, s_smem=None):
            (kk,) = idx
            plgpu.wgmma(acc_ref, a_smem, weights(kk, b_smem, s_smem, w_smem))
            plgpu.wgmma_wait(delay)

        pipeline(step)
        return acc_ref[...]

    return pl.run_scoped(mma, plgpu.ACC((bm, bn), jnp.float32))
