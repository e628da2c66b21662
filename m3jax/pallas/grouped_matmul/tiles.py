"""What the grouped GEMM's schedules share: groups' rows and the visits dealt to them, E8M0 scales, the
MXFP8 weight tile dequantised in registers.

Both MMA schedules, the non-persistent pipeline (:mod:`.kernel`) and the persistent warp-specialised
kernel (:mod:`.persistent`), dequantise an fp8 weight tile into a bf16 SMEM tile that the MMA reads; the
gemv schedule (:mod:`.gemv`) builds the same scales for its partial sums.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import plgpu


def cumsum(x):
    """Inclusive prefix sum of a short int vector (per group: rows, visits) as one compare-and-sum
    reduction: XLA's GPU cumsum is reduce-window kernels, two of them 6.4 us at decode for 128 experts
    (H200, 2026-12-02: in front of every grouped-GEMM launch of a 0.13 ms MoE block)."""
    i = jnp.arange(x.shape[0])
    return jnp.sum(jnp.where(i[None, :] <= i[:, None], x[None, :], 0), axis=1, dtype=x.dtype)


def group_rows(group_sizes, m: int):
    """(starts, ends), int32 [G]: group i owns rows ``[starts[i], ends[i])`` of the first ``m`` rows (rows
    sorted by group; a negative size counts as 0)."""
    ends = jnp.minimum(cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def deal_visits(count, n_visits: int):
    """Visits ``0 .. n_visits - 1`` dealt to the groups in order, ``count[i]`` to group i: per visit int32
    (group, ordinal within the group, live). Visits past ``sum(count)`` are dead and get the last group.

    The group lookup is ``searchsorted(cumsum(count), visit, side="right")`` as one compare-and-sum
    fusion: the default scan method is a loop of log2(G) steps of two small kernels each on the GPU, 13 us
    at decode (H200, 128 experts) before a 22 us kernel (one token's MXFP8 routed gate)."""
    cum = cumsum(count)
    visit = jnp.arange(n_visits, dtype=jnp.int32)
    owner = jnp.searchsorted(cum, visit, side="right", method="compare_all").astype(jnp.int32)
    grp = jnp.minimum(owner, count.shape[0] - 1)
    return grp, visit - (cum[grp] - count[grp]), visit < cum[-1]


def e8m0_scale(e):
    """int32 E8M0 exponents (any layout) -> float32 2^(e - 127): e = 0 is the subnormal 2^-127 (bits
    0x00400000), e = 255 inf (``dequantize_mxfp8``'s ldexp). ``max(e << 23, 0x00400000)`` is two
    instructions, e = 0 included (e >= 1 gives bits >= 0x00800000), against a compare and select."""
    return lax.bitcast_convert_type(jnp.maximum(e << 23, jnp.int32(0x00400000)), jnp.float32)


def dequantize_tile(q_smem, s_smem, w_smem, group: int) -> None:
    """fp8 e4m3 weight tile ``q_smem [bk, bn]`` times its E8M0 scales ``s_smem [bk / group, bn]`` (SMEM)
    -> bf16 ``w_smem [bk, bn]`` (SMEM, swizzled for the MMA), fenced for the MMA that reads it.

    In registers, WGMMA_8BIT layout (4-byte SMEM loads of the fp8 tile; the decode kernel's fp8 key
    pages take the same road): e4m3 -> f16 (one ``cvt`` per pair on any ptxas; e4m3 -> bf16 needs PTX ISA
    9.2) -> f32, times 2^(e - 127) (:func:`e8m0_scale`), one scale row per ``group`` rows broadcast down the
    columns. An e4m3 value (3 mantissa bits) times a power of two is exact in bf16
    (8 bits) above bf16's normal range floor, so the MMA sees exactly the weights a dequantise-on-load
    model holds in bf16.

    The consumers issue this conversion between their MMAs, so its instruction count sets the kernel's
    speed (H200, ``benchmarks/mxfp8_dequant.py``: the same kernel with no conversion runs faster than the
    bf16 one). In this layout a thread holds 2 rows x 32 columns of the tile, so every scale it builds
    serves only 2 weights: hence :func:`e8m0_scale`'s two instructions per scale.
    """
    bk, bn = q_smem.shape
    layout = plgpu.Layout.WGMMA_8BIT
    q = plgpu.load(q_smem, layout=layout).astype(jnp.float16).astype(jnp.float32)
    row = plgpu.broadcasted_iota(jnp.int32, (bk, bn), 0, layout=layout)
    scale = None
    for j in range(bk // group):
        e = plgpu.load(s_smem.at[j], layout=layout.reduce(0)).astype(jnp.int32)
        sj = plgpu.layout_cast(jnp.broadcast_to(e8m0_scale(e)[None, :], (bk, bn)), layout)
        scale = sj if scale is None else jnp.where(row >= j * group, sj, scale)
    w_smem[...] = (q * scale).astype(w_smem.dtype)
    plgpu.commit_smem()
