"""Hopper (sm_90a) tile maths of the KV-block-major sparse attention (:mod:`.kernel`): S = Q K^T and
O = P V on ``wgmma`` into register accumulators, the softmax in registers; the S and PV products are
also the query-major baseline's (a Hopper-only kernel). Chosen by :func:`m3jax.pallas._backend.arch_module`."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import pl, plgpu
from m3jax.pallas._common import LN2, LOG2E, split_products
from m3jax.pallas.sparse_attention.tile import p_operands, row_limits


def kv_major_tiles(m: int, stage_p: bool, kbs: tuple[int, ...]) -> tuple[int, bool, tuple[int, ...]]:
    """The KV-major plan's rows per tile, P staging and key blocks to try: the configured ones."""
    return m, stage_p, kbs


def wgmma_scores(q_tiles, k_tiles, shape, n_parts):
    """S = Q K^T over the parts' products into a fresh fp32 accumulator."""
    def qk(acc_ref):
        for a, c in split_products(n_parts):
            plgpu.wgmma(acc_ref, q_tiles[a], k_tiles[c].transpose((1, 0)))
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))


def wgmma_pv(p_parts, v_tiles, shape, n_parts):
    """P V over the parts' products into a fresh fp32 accumulator."""
    def pv(acc_ref):
        for a, c in split_products(n_parts):
            plgpu.wgmma(acc_ref, p_parts[a], v_tiles[c])
        return acc_ref[...]

    return pl.run_scoped(pv, plgpu.ACC(shape, jnp.float32))


def tile(plan, dtype):
    """Hopper's tile maths for :func:`.kernel._kv_major_body` (a :class:`.kernel.KVMajorPlan`): S and O
    accumulate in registers (wgmma).

    Returns (attend, scratch). ``attend(q_tiles, k_tiles, v_tiles, lims, o_smem, p_smem, mma_refs,
    scores_done)``: S = Q K^T, ``scores_done()`` once Q is consumed, the causal mask when ``lims``
    (the tile's per-token limits) is given, the softmax, O = P V normalised into ``o_smem`` (in its
    dtype); returns the natural-log LSE [m]. ``scratch``: what it needs beyond the kernel's own
    (``mma_refs``; none here)."""
    m, gp, bs, n_parts = plan.m, plan.gp, plan.kb, plan.n_parts
    scale = (plan.h**-0.5) * LOG2E

    def attend(q_tiles, k_tiles, v_tiles, lims, o_smem, p_smem, mma_refs, scores_done):
        s = wgmma_scores(q_tiles, k_tiles, (m, bs), n_parts) * scale
        scores_done()
        if lims is not None:  # only tiles holding a query whose own block this is
            col = plgpu.broadcasted_iota(jnp.int32, (m, bs), 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where(col <= row_limits(lims, m, bs, gp), s, -jnp.inf)
        mx = s.max(axis=1)
        p = jnp.exp2(s - lax.broadcast_in_dim(mx, s.shape, [0]))
        l = p.sum(axis=1)
        acc = wgmma_pv(p_operands(p, p_smem, n_parts, dtype), v_tiles, (m, plan.h), n_parts)
        o_smem[...] = (acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])).astype(o_smem.dtype)
        return (mx + jnp.log2(l)) * LN2

    return attend, []
