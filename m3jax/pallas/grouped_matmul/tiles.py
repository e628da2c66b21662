"""What the grouped GEMM's schedules share: groups' rows and the visits dealt to them, E8M0 scales, the
MXFP8 weight tile dequantised in registers.

Both MMA schedules, the non-persistent pipeline (:mod:`.kernel`) and the persistent warp-specialised
kernel (:mod:`.persistent`), dequantise an fp8 weight tile into a bf16 SMEM tile that the MMA reads; the
gemv schedule (:mod:`.gemv`) builds the same scales for its partial sums.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import pl, plgpu, tiled_layout
from m3jax.pallas._common import swizzle_transforms


class RowGroups(NamedTuple):
    """Per-row groups in place of ``group_sizes``: row ``r`` of the lhs is multiplied by group ``ids[r]``
    (int32 [M]) and is a visit of its own, whatever the rows' order. One decode token's routed experts:
    its k experts are distinct, so each weight is still read once, and the rows need no sort by expert,
    no group sizes and no schedule: the kernels read visit r's group from the ids (``m3jax.moe.moe_sorted``).
    The pipeline and gemv schedules take it; ids outside ``[0, G)`` are the caller's error, as sizes past
    M are."""

    ids: jax.Array


def cumsum(x):
    """Inclusive prefix sum of a short int vector (per group: rows, visits) as one compare-and-sum
    reduction: XLA's GPU cumsum is reduce-window kernels, whose time in front of every grouped-GEMM
    launch is a visible part of a decode MoE block (benchmarks/RESULTS.md#gmm-tile-figures)."""
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
    fusion: the default scan method is a loop of log2(G) steps of two small kernels each on the GPU,
    comparable to the decode kernel it precedes (benchmarks/RESULTS.md#gmm-tile-figures)."""
    cum = cumsum(count)
    visit = jnp.arange(n_visits, dtype=jnp.int32)
    owner = jnp.searchsorted(cum, visit, side="right", method="compare_all").astype(jnp.int32)
    grp = jnp.minimum(owner, count.shape[0] - 1)
    return grp, visit - (cum[grp] - count[grp]), visit < cum[-1]


def e8m0_scale(e, dtype=jnp.float32):
    """int32 E8M0 exponents (any layout) -> 2^(e - 127) in ``dtype`` (float32 or bfloat16, which share
    the exponent field): e = 0 is the subnormal 2^-127, e = 255 inf (``dequantize_mxfp8``'s ldexp).
    The bits are ``max(e << mantissa, 2^-127's bits)``: two instructions, e = 0 included (e >= 1 gives
    the larger bits), against a compare and select."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return lax.bitcast_convert_type(jnp.maximum(e << 7, jnp.int32(0x0040)).astype(jnp.int16), jnp.bfloat16)
    return lax.bitcast_convert_type(jnp.maximum(e << 23, jnp.int32(0x00400000)), jnp.float32)


# A [rows, columns] tile (rows % 8 == 0 == columns % 64) over the warpgroup: each warp holds 16 columns
# of every 64 and every row; a thread holds 4-element vectors along the columns (4-byte loads of fp8,
# 8-byte stores of bf16), lane = column quad x 8 + row in 8: a warp's access is 8 rows of one 16-byte
# chunk each, distinct banks under any swizzle (the row-major lane order's bf16 stores into the
# swizzled tile are refused by Mosaic GPU's transfer planner as bank-conflicting). So a scale row
# broadcast down the rows is in registers each thread reuses for all its rows: 8 scales per thread
# for a 128-column tile, whatever its depth. WGMMA_8BIT instead deals the rows to the warps (16 each),
# which leaves a thread 2 rows x 32 columns of a 64-deep tile: both scale rows of its 32 columns built
# (64 scales for 64 weights) and one chosen per element.
GROUP_LAYOUT = tiled_layout(((8, 64), (8, 16), (4,)), warp_dims=(-4,), lane_dims=(-2, -3))


class TilePlan(NamedTuple):
    """How an MXFP8 weight tile is converted: the register layout of a scale group's rows, and the SMEM
    transforms of the fp8 tile (the TMA's destination, read only by the conversion) and of the MMA's
    operands (the bf16 tile the conversion writes, and the lhs tile: Mosaic GPU wants a wgmma's two
    SMEM operands swizzled alike). A layout's loads and stores must be conflict-free under them."""

    layout: object
    fp8_transforms: tuple
    bf16_transforms: tuple


def tile_plan(cols: int) -> TilePlan:
    """The conversion plan of a ``[rows, cols]`` tile (``cols % 64 == 0``): GROUP_LAYOUT, each tile at the
    widest swizzle its rows allow. (``benchmarks/mxfp8_dequant.py``'s ``quad_layout``: a layout sharing each
    scale over 8 rows needs the fp8 tile swizzled by 32 bytes and the MMA's operands by 64; it ran no
    faster, and the narrower swizzles cost the MMAs time: benchmarks/RESULTS.md#gmm-tile-figures.)"""
    return TilePlan(GROUP_LAYOUT, swizzle_transforms(cols, 1), swizzle_transforms(cols))


def dequantize_tile(q_smem, s_smem, w_smem, group: int, scale_dtype=jnp.bfloat16) -> None:
    """fp8 e4m3 weight tile ``q_smem [bk, bn]`` times its E8M0 scales ``s_smem [bk / group, bn]`` (SMEM)
    -> bf16 ``w_smem [bk, bn]`` (SMEM, swizzled for the MMA), fenced for the MMA that reads it. The
    tiles carry :func:`tile_plan`'s transforms for ``bn``.

    One scale group (``group`` rows) at a time, in registers (the plan's layout: 4-byte SMEM loads
    of the fp8 tile): e4m3 -> f16 (one ``cvt`` per pair on any ptxas; e4m3 -> bf16 needs PTX ISA 9.2)
    -> bf16, both exact (3 mantissa bits), times 2^(e - 127) in bf16 (:func:`e8m0_scale`) broadcast
    down the group's rows. An e4m3 value times a power of two is exact in bf16 above bf16's normal
    range floor, so the MMA sees exactly the weights a dequantise-on-load model holds in bf16 (one
    rounding of the exact product either way below it).

    The consumers issue this conversion between their MMAs, so its instruction count sets the kernel's
    speed (``benchmarks/mxfp8_dequant.py``: the same kernel converting without the scales runs as
    fast as the bf16 one). Per group a thread builds the scales of its columns once (4 of every 64) and
    reuses each for all its rows of the group (4 of 32 rows), and the bf16 multiply is one ``mul.bf16x2``
    per pair, against two float32 multiplies (``scale_dtype=jnp.float32``, the same weights: kept for
    ``benchmarks/mxfp8_dequant.py``'s comparison).
    """
    bk, bn = q_smem.shape
    layout = tile_plan(bn).layout
    for j in range(bk // group):
        rows = pl.ds(j * group, group)
        q = plgpu.load(q_smem.at[rows], layout=layout).astype(jnp.float16).astype(scale_dtype)
        e = plgpu.load(s_smem.at[j], layout=layout.reduce(0)).astype(jnp.int32)
        scale = plgpu.layout_cast(jnp.broadcast_to(e8m0_scale(e, scale_dtype)[None, :], (group, bn)), layout)
        w_smem.at[rows][...] = (q * scale).astype(w_smem.dtype)
    plgpu.commit_smem()
