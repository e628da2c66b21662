"""Per-tile maths shared by the KV-block-major kernel's Hopper (wgmma, :mod:`.kernel`) and Blackwell
(tcgen05, :mod:`.blackwell`) variants: the per-part SMEM views, the causal limits of a tile's rows,
P as the second MMA's operand. Its own module so both variants import it and neither imports the
other."""

from __future__ import annotations

import jax.numpy as jnp

from m3jax.pallas._backend import plgpu
from m3jax.pallas._common import p_mma_parts


def parts(ref, n_parts: int) -> list:
    """The per-part views of a :func:`.kernel.parts_shape` SMEM ref."""
    return [ref] if n_parts == 1 else [ref.at[a] for a in range(n_parts)]


def row_limits(lims, m, bs, g, layout=plgpu.Layout.WGMMA):
    """[m, bs] int32 tile (registers in ``layout``) whose row r holds lims[r // g] (a select ladder over
    the row groups)."""
    row = plgpu.broadcasted_iota(jnp.int32, (m, bs), 0, layout=layout)
    out = jnp.full((m, bs), lims[-1], jnp.int32)
    for i in range(len(lims) - 2, -1, -1):
        out = jnp.where(row < (i + 1) * g, lims[i], out)
    return out


def p_operands(p, p_smem, n_parts, dtype):
    """P as the PV wgmma's A operand(s): bf16 parts of the fp32 probabilities (split in the kernel for
    fp32), through SMEM when ``p_smem`` is given (interpret mode), else registers."""
    p_parts = p_mma_parts(p, n_parts, dtype)
    if p_smem is None:
        return p_parts
    p_refs = parts(p_smem, n_parts)
    for a in range(n_parts):
        p_refs[a][...] = p_parts[a]
    plgpu.commit_smem()
    return p_refs
