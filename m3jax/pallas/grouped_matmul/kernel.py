"""Mosaic GPU kernel: grouped GEMM (``jax.lax.ragged_dot``) for the MoE experts.

``out[r] = lhs[r] @ rhs[g(r)]`` where the rows of ``lhs [M, K]`` are sorted by group and group ``g``
owns the ``group_sizes[g]`` rows after the previous groups'. Rows past ``sum(group_sizes)`` are
written as zeros (as ``ragged_dot`` does); a sum larger than ``M`` is clipped to ``M``.

Design (Hopper, ``Target.HOPPER``):

* Tile schedule (``tile_schedule``, plain XLA on ``G + M / block_m`` integers; or, for one decode
  token's experts, a visit per row whose group the kernel reads from ``tiles.RowGroups``' ids). Row tiles are
  aligned to ``block_m`` and may straddle group boundaries: a tile crossed by ``j`` boundaries is
  *visited* ``j + 1`` times, once per group that owns some of its rows, and each visit owns the row
  range ``[lo, hi)`` of the tile that belongs to its group. Visits are listed group by group, so a
  group's visits are adjacent. Rows past the sum are one extra "zero group" (id ``G``) whose visits
  store zeros without loading anything. There are at most ``cdiv(M, block_m) + min(G + 1, M) - 1``
  visits, which fixes the launch grid statically; unused entries have ``lo == hi`` and exit at once.
* Launch. A 1-D grid of ``visits x N tiles``, the N tile varying fastest: the CTAs running together
  share the same LHS row tile (read from HBM once for all N tiles) and the visits of one group (the
  expert's weights, read from HBM about once and then from L2).
* Main loop. Each CTA reads its ``(group, tile, lo, hi)`` entry from GMEM and runs a K loop with
  ``plgpu.emit_pipeline``: TMA copies of ``lhs[tile rows, k block]`` and ``rhs[group, k block,
  n block]`` into 128-byte-swizzled SMEM (``max_concurrent_steps`` buffers), one ``wgmma`` per step
  into a fp32 register accumulator, ``wgmma_wait(1)`` so a buffer is refilled only after the wgmma
  that read it retired (``delay_release=1``). The whole ``block_m`` rows are multiplied; rows of
  other groups are discarded at the store.
* Masked store. The accumulator is cast to the output dtype into an SMEM tile (its scope reuses
  the pipeline buffers) and only rows ``[lo, hi)`` go back by TMA: aligned 8-row chunks that lie
  fully inside the range, then up to 7 single rows at each ragged end, each copy under its own
  condition (at most ``bm / 8 + 14`` conditional TMA issues, no read-modify-write). Two visits
  of a straddling tile therefore write disjoint rows of the same output tile and never race.
* fp32 inputs. The MMA is bf16: fp32 ``lhs``/``rhs`` are split into three bf16 pieces
  (``_common.bf16_split(x, 3)``) and the kernel runs once on K-concatenated operands, the six part
  products of ``_common.split_products(3)`` side by side (6x the MMA work, ~24 mantissa bits: fp32
  accuracy, so an fp32 model's MoE meets the 1e-5 oracle bound; two pieces, "bf16x3", measured
  ~5e-6 relative on random normals, half of that bound per layer).
* MXFP8 weights (``grouped_matmul_mxfp8``): ``rhs`` float8_e4m3fn with uint8 E8M0 scales per 32
  inputs. The pipeline brings in the fp8 tile and its two scale rows per K step (1 + 1/32 bytes per
  weight instead of 2); the warpgroup dequantises the tile in registers into one of two bf16 SMEM
  tiles (``tiles.dequantize_tile``), which the MMA reads; the MMA wait that frees the pipeline's buffers
  (one step late) frees that tile too. Same schedule, store and MMA paths (wgmma and tcgen05).
* Backward (``jax.custom_vjp``): ``d lhs = d out . rhs[g]^T`` is this kernel again with the RHS
  tiles read transposed (``transpose_rhs``: ``[bn, bk]`` tiles of ``rhs [G, N', K']``, no copy),
  where the shapes allow; ``d rhs`` contracts over the ragged rows and still goes through
  ``jax.lax.ragged_dot``'s VJP (a transposed grouped-GEMM kernel is the next step for training).

Limits (``unsupported_reason``): ``K % block_k == 0``, ``N % block_n == 0``, ``block_m`` 64 or
128 (256 or 384 on the warp-specialised schedule with ``wg_split="m"``), ``block_n`` a multiple of 64 up to
256 and ``block_m * block_n <= 128 * 128`` (one warpgroup holds the fp32 accumulator in 128 registers
per thread).

The persistent, warp-specialised variant (``GroupedMatmulConfig(schedule="warp_specialized")``,
:mod:`.persistent`: one CTA per SM over the work items, a TMA producer warpgroup and two consumer
warpgroups, group-aligned row tiles, split-K for decode) has the same signature and reference; the
MoE layer runs it for prefill on Hopper (``LAYER_SCHEDULE``, as measured) and, split over K,
for MXFP8 decode GEMMs whose experts with rows are too few to fill the SMs; this pipeline schedule for
the other decode GEMMs, on Blackwell, and as ``GroupedMatmulConfig()``'s default.

MXFP8 at decode row counts runs a third schedule, ``GroupedMatmulConfig(schedule="gemv")`` (:mod:`.gemv`:
CUDA-core FMAs over the fp8 rows, the scales applied to 32-row partial sums, no bf16 tile, no MMA).

Per architecture (:mod:`.hopper`, :mod:`.blackwell`, picked by :func:`m3jax.pallas._backend.arch_module`):
the schedule, the pipeline and the masked store stay; the MMA of each K step differs. On Blackwell it
is ``plgpu.tcgen05_mma`` into a TMEM accumulator, each step's MMA committed to one of two barriers and
waited one step later (so the pipeline refills a buffer only after the MMA that read it), the
accumulator read back with ``async_load_tmem`` for the store. Tested in interpret mode and
lowered for sm_100a on a CPU; never run on a B200 (``m3jax.selfcheck``'s canary decides there). Not
done: ``block_m=256`` on a 2-CTA cluster (``cluster=2``, each CTA loading half of the RHS tile,
``collective_axes`` on the copies), two TMEM accumulator stages so an MMA warp starts the next visit
while the epilogue warps store this one, and ``block_n`` beyond the register limit above (the
epilogue would load TMEM in column chunks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from m3jax.pallas._backend import arch_module, current_target, mosaic_kernel, pl, plgpu
from m3jax.pallas._common import bf16_split, check_dims, split_products, swizzle_transforms
from m3jax.pallas.grouped_matmul import blackwell, gemv, hopper, persistent, reference, tiles
from m3jax.pallas.grouped_matmul.tiles import RowGroups, deal_visits, dequantize_tile, group_rows

ROW_CHUNK = 8  # rows per aligned TMA store chunk


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tile configuration. ``block_m``: rows per tile (64 or 128; 256 or 384 warp-specialised with
    ``wg_split="m"``); ``block_n``: output columns per CTA (pipeline: 64..256, multiple of 64; warp-specialised:
    up to 512, multiple of 128; with ``wg_split="m"`` 64..256, multiple of 64, and at most 128 at ``block_m``
    256 or 384); ``block_k``: K per pipeline step (64 = one 128-byte swizzled bf16 row);
    ``max_concurrent_steps``: K steps in flight (capped by SMEM).

    ``schedule``: ``"pipeline"`` (this module: one warpgroup per CTA, a CTA per work item, tiles
    aligned to ``block_m``) or ``"warp_specialized"`` (:mod:`.persistent`: one CTA per SM, a TMA
    producer warpgroup and two consumer warpgroups of ``block_n / 2`` columns each, group-aligned
    tiles; Hopper only). ``split_k``: K parts of each work item, summed in fp32 by XLA
    (``"warp_specialized"`` only; for decode, where the few rows per expert give too few items).
    ``wg_split`` (``"warp_specialized"`` only): how the two consumers share the CTA tile, ``"n"``
    (half the columns each) or ``"m"`` (``block_m / 2`` rows each, in 64-row chunks that are multiplied
    only where they hold rows of the visit; ``block_m`` 128, or 256 or 384 with ``block_n <= 128``: the
    256- and 384-row tiles, one weight tile per K step for up to that many of an expert's rows,
    ``PREFILL_ROWS256`` and ``PREFILL_ROWS384``).
    ``cluster`` (``"warp_specialized"`` only): CTAs per cluster, 1 or 2; with 2 a cluster's CTAs take
    adjacent N tiles of the same visit and load its lhs tile once between them (TMA multicast, each
    CTA half of it)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    schedule: str = "pipeline"
    split_k: int = 1
    wg_split: str = "n"
    cluster: int = 1


# The MoE layer's schedule per regime (decode: at most 64 rows per expert on average): at prefill
# sizes the warp-specialised schedule (tiles below) is the faster in bf16 and MXFP8; at decode the
# pipeline is as fast or faster, so decode keeps it. DECODE_SPLIT_K: the split for decode on the
# warp-specialised schedule (benchmarks/RESULTS.md#gmm-schedules).
LAYER_SCHEDULE = {"prefill": "warp_specialized", "decode": "pipeline"}
DECODE_SPLIT_K = 4
# The 256-row tiles (consumers of 128 rows in 64-row chunks, block_n 128): one weight tile per K step
# serves all of a ~256-row expert's rows, a group's few remaining rows go in a short 128-row visit, and
# the MMAs skip 64-row chunks without rows, where the 128 x 256 tile multiplies whole 128-row tiles.
# The layer's bf16 prefill tile: faster than 128 x 256 at 128 and 256 rows per expert; MXFP8 keeps
# 128 x 256, on which its fp8 -> bf16 conversion is the faster (benchmarks/RESULTS.md#gmm-rows256).
PREFILL_ROWS256 = GroupedMatmulConfig(block_m=256, block_n=128, schedule="warp_specialized", wg_split="m")
# The 384-row tiles (consumers of 192 rows): past ~256 rows per expert a 256-row tile leaves many experts a
# second visit that streams their weights again; a 384-row tile takes each in one. Faster in bf16 at 256
# rows per expert, slower at 128 (a taller lhs tile per visit) and in MXFP8 (each consumer converts the
# whole fp8 tile) (benchmarks/RESULTS.md#gmm-rows384). The layer takes them for bf16 from ROWS384_MIN_ROWS
# rows per expert on average, where a ~256-row expert's spread (about +-16 rows for random routing) starts
# to cross 256.
PREFILL_ROWS384 = dataclasses.replace(PREFILL_ROWS256, block_m=384)
ROWS384_MIN_ROWS = 224
PREFILL_128X256 = GroupedMatmulConfig(block_m=128, block_n=256, schedule="warp_specialized")
# MXFP8 decode where the pipeline's CTAs (one per 128 columns of each expert with rows, each converting
# its whole K of fp8 tiles) are fewer than the SMs, past the gemv schedule's rows (below; a dense weight's
# 9-64 rows, one group). There the warp-specialised schedule splits K until there are MXFP8_DECODE_ITEMS_PER_SM work
# items per SM (faster than the pipeline there; where the pipeline fills the SMs it stays as fast or
# faster: benchmarks/RESULTS.md#gmm-schedules).
MXFP8_DECODE_ITEMS_PER_SM = 2
# MXFP8 at decode row counts runs the gemv schedule (:mod:`.gemv`, CUDA-core FMAs, no bf16 tile): up to
# GEMV_MAX_ROWS rows and ROWS_PER_GEMV_GROUP rows per group on average (a group's rows go 8 per visit, and
# each visit streams the group's weights): at 1 and 8 tokens the routed GEMMs take well under the bf16
# kernel's time there, against more than it on the MMA schedules, and a dense weight's 16 rows (two
# visits) match the split-K MMA schedule (benchmarks/RESULTS.md#mxfp8-dense-rows).
GEMV_MAX_ROWS = 64
ROWS_PER_GEMV_GROUP = 8
MXFP8_DECODE_SPLITS = (2, 4, 8, 16)


def layer_config(m: int, k: int, n: int, g: int, k_groups: int | None = None, weights: int = 1) -> GroupedMatmulConfig:
    """The MoE layer's config for ``[m, k] x [g, k, n]`` (``k_groups``: MXFP8 weights' scale rows; ``weights``:
    how many such weights times the same rows one launch takes, ``grouped_matmuls_mxfp8``):
    the gemv schedule for MXFP8 at decode rows (``GEMV_MAX_ROWS``, ``ROWS_PER_GEMV_GROUP``), else
    ``LAYER_SCHEDULE``'s for the regime, split-K on the warp-specialised schedule for MXFP8 decode that
    would leave SMs idle (``_mxfp8_decode_split``), the pipeline's where those cannot take the shape."""
    decode = m <= 64 * g  # few rows per expert: 64-row tiles waste less of each tile
    if k_groups and m <= min(GEMV_MAX_ROWS, ROWS_PER_GEMV_GROUP * g):
        cfg = GroupedMatmulConfig(block_m=64, block_n=gemv.BLOCK_N, block_k=gemv.BLOCK_K, schedule="gemv",
                                  split_k=gemv.decode_split(m, k, n, g, weights))
        if gemv.unsupported_reason(m, k, n, g, k_groups, cfg) is None:
            return cfg
    if decode and k_groups:
        split = _mxfp8_decode_split(m, k, n, g)
        if split:
            cfg = GroupedMatmulConfig(block_m=64, block_n=256, schedule="warp_specialized", split_k=split)
            if mxfp8_unsupported_reason(m, k, n, g, k_groups, cfg) is None:
                return cfg
    if LAYER_SCHEDULE["decode" if decode else "prefill"] == "warp_specialized":
        if decode:
            split = next(s for s in (DECODE_SPLIT_K, 2, 1) if k % (s * 64) == 0)
            candidates = [GroupedMatmulConfig(block_m=64, block_n=256, schedule="warp_specialized", split_k=split)]
        else:  # bf16 on the 384- or 256-row tiles; MXFP8 (and bf16 where those cannot run) on 128 x 256, the
            # consumers splitting N (RESULTS.md#gmm-rows384, #gmm-rows256, #gmm-schedules)
            rows = PREFILL_ROWS384 if m >= ROWS384_MIN_ROWS * g else PREFILL_ROWS256
            candidates = [*([] if k_groups else [rows]), PREFILL_128X256]
        for cfg in candidates:
            reason = (mxfp8_unsupported_reason(m, k, n, g, k_groups, cfg) if k_groups
                      else unsupported_reason(m, k, n, g, cfg))
            if reason is None:
                return cfg
    return GroupedMatmulConfig(block_m=64 if decode else 128)


def _mxfp8_decode_split(m: int, k: int, n: int, g: int) -> int | None:
    """The K split for MXFP8 decode on the warp-specialised schedule (block_n 256), or None where the
    pipeline's ``min(m, g) * n / 128`` CTAs already give every SM one (at most ``min(m, g)`` groups
    have rows) or K cannot be split. The caller checks the rest of the schedule's limits."""
    sms = current_target().num_sms
    experts = min(m, g)
    if experts * (n // 128) >= sms:
        return None
    splits = [s for s in MXFP8_DECODE_SPLITS if k % (s * 64) == 0]
    if not splits:
        return None  # unsplit, the warp-specialised schedule was the slower (RESULTS.md#gmm-schedules)
    want = MXFP8_DECODE_ITEMS_PER_SM * sms
    return next((s for s in splits if experts * (n // 256) * s >= want), splits[-1])


def unsupported_reason(m: int, k: int, n: int, g: int, config: GroupedMatmulConfig | None = None) -> str | None:
    """Why the kernel cannot take ``lhs [m, k] x rhs [g, k, n]`` (None when it can)."""
    c = config or GroupedMatmulConfig()
    if c.schedule == "gemv":
        return "the gemv schedule takes MXFP8 weights only (grouped_matmul_mxfp8)"
    if c.schedule == "warp_specialized":  # its block_m rule is the schedule's own
        return _shared_reason(m, k, n, g, c) or persistent.unsupported_reason(k, n, c)
    if c.block_m not in (64, 128):
        return f"block_m={c.block_m} must be 64 or 128 (256, 384: schedule='warp_specialized', wg_split='m')"
    if c.schedule != "pipeline":
        return f"schedule={c.schedule!r} must be 'pipeline', 'warp_specialized' or 'gemv' (MXFP8)"
    if c.split_k != 1 or c.wg_split != "n" or c.cluster != 1:
        return (f"split_k={c.split_k}, wg_split={c.wg_split!r}, cluster={c.cluster}: the pipeline schedule has one "
                "warpgroup, no K split and no clusters")
    if c.block_n % 64 or not 64 <= c.block_n <= 256:
        return f"block_n={c.block_n} must be a multiple of 64 in [64, 256]"
    if reason := arch_module(hopper, blackwell).tile_reason(c.block_m, c.block_n):
        return reason
    if c.block_m * c.block_n > 128 * 128:
        return (f"block_m * block_n = {c.block_m * c.block_n} > 16384: the fp32 accumulator would need more "
                "than 128 registers per thread of one warpgroup")
    return _shared_reason(m, k, n, g, c)


def _shared_reason(m: int, k: int, n: int, g: int, c: GroupedMatmulConfig) -> str | None:
    if c.block_k != 64:
        return f"block_k={c.block_k} must be 64 (one 128-byte swizzled bf16 row)"
    if k % c.block_k:
        return f"K={k} must be a multiple of block_k={c.block_k}"
    if n % c.block_n:
        return f"N={n} must be a multiple of block_n={c.block_n}"
    if g < 1 or m < 1:
        return f"empty problem (M={m}, G={g})"
    return None


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """int32 [visits, 4]: per visit (group, row tile, lo, hi), rows ``[lo, hi)``.

    ``group_sizes`` int [G]: ``cdiv(m, block_m) + min(G + 1, m) - 1`` visits, group ``G`` the zero group
    (rows ``[sum, m)``), unused entries with ``lo == hi == 0``. A row tile is visited once per group
    with rows in it, and at most ``min(G + 1, m)`` groups (the zero group included) have rows, so the
    visits past the tiles are one per boundary between them: at decode a few, not one per expert
    (dead visits are CTAs that start and exit). :class:`.tiles.RowGroups` need no schedule: the kernel
    reads visit r's group from the ids (row r, alone)."""
    g = group_sizes.shape[0]
    starts, ends = group_rows(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first = starts // block_m
    last = jnp.where(ends > starts, (ends + block_m - 1) // block_m, first)
    gc, ordinal, valid = deal_visits(last - first, -(-m // block_m) + min(g + 1, m) - 1)  # tiles touched, per group
    tile = first[gc] + ordinal
    lo = jnp.maximum(starts[gc], tile * block_m)
    hi = jnp.minimum(ends[gc], tile * block_m + block_m)
    zero = jnp.zeros_like(gc)
    return jnp.stack([gc, jnp.where(valid, tile, zero), jnp.where(valid, lo, zero), jnp.where(valid, hi, zero)],
                     axis=1)


def _pipeline_steps(k: int, config: GroupedMatmulConfig, scale_rows: int = 0) -> int:
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if scale_rows:  # per stage: bf16 lhs tile, fp8 weight tile, its scale rows; plus two bf16 weight tiles
        stage, fixed = bm * bk * 2 + bk * bn + scale_rows * bn, 2 * bk * bn * 2
    else:
        stage, fixed = (bm + bn) * bk * 2, 0
    fit = (current_target().smem_bytes - 4096 - fixed) // stage
    return max(1, min(config.max_concurrent_steps, fit, k // config.block_k))


def _store_rows(o_smem, out_ref, *, t0, lo, hi, col0, block_m, block_n):
    """TMA rows [lo, hi) of the tile starting at row t0: aligned 8-row chunks, then single edge rows."""
    a = (lo + ROW_CHUNK - 1) // ROW_CHUNK * ROW_CHUNK
    b = hi // ROW_CHUNK * ROW_CHUNK

    def put(row, rows, pred):
        # pl.when rather than the copy's predicate= (which interpret mode does not implement);
        # either way one lane issues the TMA.
        @pl.when(pred)
        def _():
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(row - t0, rows)],
                                    out_ref.at[pl.ds(row, rows), pl.ds(col0, block_n)])

    for c in range(block_m // ROW_CHUNK):
        row = t0 + c * ROW_CHUNK
        put(row, ROW_CHUNK, (row >= a) & (row + ROW_CHUNK <= b))
    head_end = jnp.minimum(a, hi)
    for j in range(ROW_CHUNK - 1):
        put(lo + j, 1, lo + j < head_end)
        put(b + j, 1, (b + j >= a) & (b + j < hi))


def _kernel_call(group_sizes, m_used, lhs, rhs, *, out_dtype, config: GroupedMatmulConfig, transpose_rhs=False,
                 interpret=None, rhs_scales=None):
    """The groups cover rows [0, m_used) of lhs bf16 [M, K] (M >= block_m; rows past m_used come out
    unspecified or not at all, the callers cut them); rhs bf16 [G, K, N], or
    [G, N, K] with ``transpose_rhs`` (the backward's d lhs = d out . rhs^T, without a transpose copy), or
    float8_e4m3fn [G, K, N] with ``rhs_scales`` uint8 [G, K / group, N] (MXFP8: dequantised per tile in
    the kernel, :func:`.tiles.dequantize_tile`). ``config.schedule`` picks the kernel. On the pipeline
    schedule (bf16) ``rhs`` may also be a tuple of arrays whose groups follow one another, or a list of
    several such weights times the same rows, one output each (a list back), in one launch."""
    if config.schedule == "warp_specialized":
        return persistent.kernel_call(group_sizes, m_used, lhs, rhs, out_dtype=out_dtype, config=config,
                                      transpose_rhs=transpose_rhs, interpret=interpret, rhs_scales=rhs_scales)
    # per-row groups: visit r is row r, its group read from the ids in the kernel (no XLA op before the launch)
    per_row = isinstance(group_sizes, RowGroups)
    sched = group_sizes.ids.astype(jnp.int32) if per_row else tile_schedule(group_sizes, m_used, config.block_m)
    several = isinstance(rhs, list)
    # per weight, its arrays whose groups follow one another
    weight_parts = [w if isinstance(w, tuple) else (w,) for w in (rhs if several else [rhs])]
    bases = np.cumsum([0] + [r.shape[0] for r in weight_parts[0]]).tolist()
    m, k = lhs.shape
    g = bases[-1]
    n = weight_parts[0][0].shape[1] if transpose_rhs else weight_parts[0][0].shape[2]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    n_tiles = n // bn
    n_visits = sched.shape[0]
    n_weights = len(weight_parts)
    mxfp8 = rhs_scales is not None
    group = k // rhs_scales.shape[1] if mxfp8 else 0
    plan = tiles.tile_plan(bn) if mxfp8 else None  # the conversion's layout and its tiles' swizzles
    steps = _pipeline_steps(k, config, bk // group if mxfp8 else 0)
    delay = 1 if steps > 1 else 0
    arch = arch_module(hopper, blackwell)  # the MMA's tile maths

    n_parts = sum(len(parts) for parts in weight_parts)

    def body(sched_ref, lhs_ref, *refs):
        rhs_refs, refs = iter(refs[:n_parts]), refs[n_parts:]
        scale_ref, out_refs = (refs[0], refs[1:]) if mxfp8 else (None, refs)
        pid = jax.lax.axis_index("t")
        wi, pid = jax.lax.div(pid, n_visits * n_tiles), jax.lax.rem(pid, n_visits * n_tiles)
        v, ni = jax.lax.div(pid, n_tiles), jax.lax.rem(pid, n_tiles)
        if per_row:
            grp, tile, lo, hi = sched_ref[v], jax.lax.div(v, bm), v, v + 1
        else:
            grp, tile, lo, hi = (sched_ref[v, i] for i in range(4))
        t0, col0 = tile * bm, ni * bn

        def store(values, out_ref):
            def scope(o_smem):
                o_smem[...] = values
                plgpu.commit_smem()
                _store_rows(o_smem, out_ref, t0=t0, lo=lo, hi=hi, col0=col0, block_m=bm, block_n=bn)
                plgpu.wait_smem_to_gmem(0)  # last thing the CTA does: wait for the writes too

            pl.run_scoped(scope, plgpu.SMEM((bm, bn), out_dtype))

        if transpose_rhs:
            rhs_spec = plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), transforms=swizzle_transforms(bk),
                                       delay_release=delay)
        else:
            rhs_spec = plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=delay,
                                       transforms=plan.fp8_transforms if mxfp8 else swizzle_transforms(bn))
        # MXFP8: the lhs tile swizzled as the converted weight tile, the MMA's other operand (Mosaic GPU
        # wants them alike)
        lhs_transforms = plan.bf16_transforms if mxfp8 else swizzle_transforms(bk)
        in_specs = [plgpu.BlockSpec((bm, bk), lambda kk: (tile, kk), transforms=lhs_transforms, delay_release=delay),
                    rhs_spec]
        if mxfp8:  # the fp8 tile's scale rows; read into registers at once, so released with the step
            in_specs.append(plgpu.BlockSpec((bk // group, bn), lambda kk: (kk, ni)))

        def weights(kk, b_smem, s_smem, w_smem):
            """The MMA's weight operand of step kk: the bf16 tile, or the fp8 tile dequantised into
            bf16 buffer kk % 2 (the other buffer may still be read by step kk - 1's MMA)."""
            if not mxfp8:
                return b_smem.transpose((1, 0)) if transpose_rhs else b_smem
            w = w_smem.at[lax.rem(kk, 2)]
            dequantize_tile(b_smem, s_smem, w, group)
            return w

        # MXFP8: two bf16 weight tiles, the MMA operands the fp8 tiles are dequantised into
        w_scratch = (plgpu.SMEM((2, bk, bn), jnp.bfloat16, transforms=plan.bf16_transforms),) if mxfp8 else ()

        # one copy of the main loop per weight array (a ref cannot be chosen at run time); the copies' SMEM is
        # shared, as they are scopes side by side
        for w_idx, (parts, out_ref) in enumerate(zip(weight_parts, out_refs)):
            for base, end in zip(bases, bases[1:]):
                operands = (lhs_ref, next(rhs_refs).at[grp - base], *((scale_ref.at[grp],) if mxfp8 else ()))

                def pipeline(step, operands=operands):
                    plgpu.emit_pipeline(step, grid=(k // bk,), in_specs=in_specs,
                                        max_concurrent_steps=steps)(*operands)

                def mma(w_smem=None, pipeline=pipeline):
                    return arch.accumulate(pipeline, k // bk, weights, bm=bm, bn=bn, delay=delay, w_smem=w_smem)

                @pl.when((wi == w_idx) & (hi > lo) & (grp >= base) & (grp < end))
                def _(mma=mma, out_ref=out_ref):
                    # (the SMEM tiles in a scope of their own: interpret mode refuses a register accumulator
                    # allocated together with SMEM)
                    acc = pl.run_scoped(mma, *w_scratch) if mxfp8 else mma()
                    store(acc.astype(out_dtype), out_ref)

            @pl.when((wi == w_idx) & (hi > lo) & (grp == g))
            def _(out_ref=out_ref):
                store(jnp.zeros((bm, bn), out_dtype), out_ref)

    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=tuple(jax.ShapeDtypeStruct((m, n), out_dtype) for _ in weight_parts),
        grid=(n_weights * n_visits * n_tiles,),
        grid_names=("t",),
    )
    outs = kern(sched, lhs, *(r for parts in weight_parts for r in parts), *((rhs_scales,) if mxfp8 else ()))
    return list(outs) if several else outs[0]


def _forward(lhs, rhs, group_sizes, out_dtype, config, interpret, transpose_rhs=False):
    """``rhs`` an array, a tuple of arrays whose groups follow one another, or a list of such weights (a list
    of outputs back)."""
    m = lhs.shape[0]
    bm = config.block_m
    arrays = jax.tree.leaves(rhs)
    if lhs.dtype == jnp.float32 or any(r.dtype == jnp.float32 for r in arrays):
        # the six part products along K: [l_i ...] . [r_j; ...] = sum over split_products(3) of l_i . r_j
        prods = split_products(3)
        lp = bf16_split(lhs, 3)
        lhs = jnp.concatenate([lp[i] for i, _ in prods], axis=1)
        arrays = [jnp.concatenate([rp[j] for _, j in prods], axis=2 if transpose_rhs else 1)
                  for rp in (bf16_split(r, 3) for r in arrays)]
    else:
        lhs, arrays = lhs.astype(jnp.bfloat16), [r.astype(jnp.bfloat16) for r in arrays]
    rhs = jax.tree.unflatten(jax.tree.structure(rhs), arrays)
    m_pad = max(m, bm)  # TMA boxes of block_m rows need at least block_m rows
    if m_pad != m:
        lhs = jnp.pad(lhs, [(0, m_pad - m), (0, 0)])
    out = _kernel_call(group_sizes, m, lhs, rhs, out_dtype=out_dtype, config=config, transpose_rhs=transpose_rhs,
                       interpret=interpret)
    return jax.tree.map(lambda o: o[:m], out) if m_pad != m else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_matmul(lhs, rhs, group_sizes, out_dtype, config, interpret):
    return _forward(lhs, rhs, group_sizes, out_dtype, config, interpret)


def _fwd(lhs, rhs, group_sizes, out_dtype, config, interpret):
    return _forward(lhs, rhs, group_sizes, out_dtype, config, interpret), (lhs, rhs, group_sizes)


def _bwd(out_dtype, config, interpret, res, d_out):
    lhs, rhs, group_sizes = res
    d_out = jax.tree.map(lambda d: d.astype(out_dtype), d_out)
    if not isinstance(rhs, jax.Array):  # weight arrays or several weights (a decode token's): the reference's
        ref = reference.grouped_matmuls if isinstance(rhs, list) else reference.grouped_matmul
        _, vjp = jax.vjp(lambda a, b: ref(a, b, group_sizes, out_dtype=out_dtype), lhs, rhs)
        return (*vjp(d_out), None)
    m, k = lhs.shape
    g, _, n = rhs.shape
    if unsupported_reason(m, n, k, g, config) is None:
        # d lhs = d out [M, N] . rhs[g]^T: the same kernel with rhs read transposed (contraction over N).
        d_lhs = _forward(d_out, rhs, group_sizes, lhs.dtype, config, interpret, transpose_rhs=True)
    else:
        _, vjp_lhs = jax.vjp(lambda a: reference.grouped_matmul(a, rhs, group_sizes, out_dtype=out_dtype), lhs)
        (d_lhs,) = vjp_lhs(d_out)
    # d rhs contracts over the ragged rows (a transposed grouped GEMM): ragged_dot's own VJP for now.
    _, vjp_rhs = jax.vjp(lambda b: reference.grouped_matmul(lhs, b, group_sizes, out_dtype=out_dtype), rhs)
    (d_rhs,) = vjp_rhs(d_out)
    return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_fwd, _bwd)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_matmul(lhs, rhs, group_sizes, *, out_dtype=None, config=None, interpret=None):
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` on the Mosaic GPU kernel.

    Args:
      lhs: [M, K] bf16 or fp32, rows sorted by group.
      rhs: [G, K, N] bf16 or fp32; with :class:`.tiles.RowGroups`, also a tuple of such arrays ``[G_i, K, N]``
        whose groups follow one another (group ``G_0 + j`` is ``rhs[1][j]``): weights kept apart, such as an
        MLP's gate and up and a shared expert beside the routed ones, in one launch.
      group_sizes: int [G], sum <= M (rows past the sum come out as zeros); or :class:`.tiles.RowGroups`
        (int32 [M], a group per row, rows in any order; the pipeline schedule).
      out_dtype: output dtype (default: the inputs' result type); accumulation is fp32.
    Returns:
      [M, N] ``out_dtype``.
    Raises:
      ValueError: shapes the kernel cannot take (``unsupported_reason``).
    """
    config = config or GroupedMatmulConfig()
    parts = _rhs_parts("grouped_matmul", lhs, rhs, group_sizes)
    _check_groups("grouped_matmul", lhs, parts[0], group_sizes, config)
    m, k = lhs.shape
    g, n = sum(r.shape[0] for r in parts), parts[0].shape[2]
    reason = unsupported_reason(m, k, n, g, config)
    if reason:
        shapes = " + ".join(str(r.shape) for r in parts)
        raise ValueError(f"grouped_matmul kernel cannot take lhs {lhs.shape} x rhs {shapes}: {reason}")
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, *(r.dtype for r in parts)))
    # The TMA store into out [M, N] needs M to be a multiple of its 8-row tiling once M exceeds it
    # (seen on the GPU only: interpret mode has no such rule). Rows past sum(group_sizes) come out
    # zero, so zero rows appended here change nothing and are cut off again.
    pad = -m % 8 if m > 8 else 0
    if pad:
        lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
    out = _grouped_matmul(lhs, rhs, group_sizes, out_dtype, config, interpret)
    return out[:m] if pad else out


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_matmuls(lhs, weights, group_sizes, *, out_dtype=None, config=None, interpret=None) -> tuple:
    """:func:`grouped_matmul` of one ``lhs`` with each weight of ``weights`` (each an array, or with per-row
    groups a tuple of arrays, all of one structure and shapes), as one launch of the pipeline schedule: a
    tuple of ``[M, N]``. One decode token's gate and up (``m3jax.moe``). Its VJP is the reference's."""
    config = config or GroupedMatmulConfig()
    weights = tuple(weights)
    if not weights:
        raise ValueError("grouped_matmuls: no weights")
    if config.schedule != "pipeline":
        raise ValueError(f"grouped_matmuls runs the pipeline schedule, not {config.schedule!r}")
    shapes = {tuple(r.shape for r in _rhs_parts("grouped_matmuls", lhs, w, group_sizes)) for w in weights}
    if len(shapes) > 1:
        raise ValueError(f"grouped_matmuls: weights of different shapes {sorted(shapes)}")
    w0 = weights[0] if isinstance(weights[0], tuple) else (weights[0],)
    _check_groups("grouped_matmuls", lhs, w0[0], group_sizes, config)
    m, k = lhs.shape
    reason = unsupported_reason(m, k, w0[0].shape[2], sum(r.shape[0] for r in w0), config)
    if reason:
        raise ValueError(f"grouped_matmuls kernel cannot take lhs {lhs.shape} x {sorted(shapes)}: {reason}")
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, *(r.dtype for r in jax.tree.leaves(weights))))
    pad = -m % 8 if m > 8 else 0  # as grouped_matmul: the TMA store's 8-row tiling
    if pad:
        lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
    outs = _grouped_matmul(lhs, list(weights), group_sizes, out_dtype, config, interpret)
    return tuple(out[:m] if pad else out for out in outs)


def mxfp8_unsupported_reason(m: int, k: int, n: int, g: int, k_groups: int,
                             config: GroupedMatmulConfig | None = None) -> str | None:
    """Why the MXFP8-weight kernel cannot take ``lhs [m, k] x (values [g, k, n], scales [g, k_groups, n])``."""
    c = config or GroupedMatmulConfig()
    if k_groups < 1 or k % k_groups:
        return f"K={k} is not a whole number of scale groups ({k_groups} scale rows)"
    if c.schedule == "gemv":
        return gemv.unsupported_reason(m, k, n, g, k_groups, c)
    group = k // k_groups
    if c.block_k % group:
        return f"scale group of {group} inputs must divide block_k={c.block_k} (one K step holds whole groups)"
    if group % 8:
        return f"scale group of {group} inputs must be a multiple of 8 (the conversion takes whole 8-row SMEM tiles)"
    return unsupported_reason(m, k, n, g, c)


def _rhs_parts(where: str, lhs, rhs, group_sizes) -> tuple:
    """``rhs`` as a tuple of weight arrays ``[G_i, K, N]`` of one K and N (checked against ``lhs [M, K]``); a
    tuple of several only with per-row groups."""
    if not isinstance(rhs, tuple):
        check_dims(where, lhs=(lhs, "M K"), rhs=(rhs, "G K N"))
        return (rhs,)
    if not rhs:
        raise ValueError(f"{where}: rhs is an empty tuple")
    if len(rhs) > 1 and not isinstance(group_sizes, RowGroups):
        raise ValueError(f"{where}: a tuple of {len(rhs)} weight arrays needs per-row groups (RowGroups)")
    for i, r in enumerate(rhs):
        check_dims(where, lhs=(lhs, "M K"), rhs0=(rhs[0], "G0 K N"), **{f"rhs[{i}]": (r, "G K N")})
    return rhs


def _check_groups(where: str, lhs, rhs, group_sizes, config: GroupedMatmulConfig) -> None:
    """``group_sizes`` int [G] for ``rhs [G, ...]``, or :class:`.tiles.RowGroups` int [M] for ``lhs [M, K]`` on a
    schedule that takes a visit per row (pipeline, gemv)."""
    if isinstance(group_sizes, RowGroups):
        check_dims(where, lhs=(lhs, "M K"), **{"group_sizes.ids": (group_sizes.ids, "M")})
        if config.schedule not in ("pipeline", "gemv"):
            raise ValueError(f"{where}: per-row groups (RowGroups) run on the pipeline or gemv schedule, not "
                             f"{config.schedule!r}")
        if not jnp.issubdtype(group_sizes.ids.dtype, jnp.integer):
            raise ValueError(f"{where}: group_sizes.ids must be integers, got {group_sizes.ids.dtype}")
    else:
        check_dims(where, rhs=(rhs, "G K N"), group_sizes=(group_sizes, "G"))


def _check_mxfp8(lhs, values, scales, group_sizes, config: GroupedMatmulConfig) -> None:
    check_dims("grouped_matmul_mxfp8", lhs=(lhs, "M K"), values=(values, "G K N"),
               scales=(scales, "G K_groups N"))
    _check_groups("grouped_matmul_mxfp8", lhs, values, group_sizes, config)
    if values.dtype != jnp.float8_e4m3fn or scales.dtype != jnp.uint8:
        raise ValueError(f"grouped_matmul_mxfp8: values must be float8_e4m3fn and scales uint8, got "
                         f"{values.dtype} and {scales.dtype}")
    m, k = lhs.shape
    g, _, n = values.shape
    reason = mxfp8_unsupported_reason(m, k, n, g, scales.shape[1], config)
    if reason:
        raise ValueError(f"grouped_matmul_mxfp8 kernel cannot take lhs {lhs.shape} x values {values.shape}: {reason}")


def _check_mxfp8_weights(name: str, lhs, weights, group_sizes, config: GroupedMatmulConfig) -> None:
    """Several weights for one launch over the same rows: one shape, each one the kernel takes."""
    shapes = {(v.shape, s.shape) for v, s in weights}
    if len(shapes) != 1:
        raise ValueError(f"{name}: weights of different shapes {sorted(shapes)}")
    for values, scales in weights:
        _check_mxfp8(lhs, values, scales, group_sizes, config)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_matmul_mxfp8(lhs, values, scales, group_sizes, *, out_dtype=None, config=None, interpret=None):
    """``ragged_dot(lhs, dequantize(values, scales), group_sizes)`` with the weights read as MXFP8.

    The fp8 tiles and their scale rows come in by TMA (1 + 1/32 bytes per weight instead of 2) and are
    dequantised to bf16 in the kernel (:func:`.tiles.dequantize_tile`) for the bf16 MMA, fp32 accumulation;
    the dequantised weights are exactly a bf16 dequantise-on-load model's, so the two agree up to
    accumulation order. fp32 ``lhs`` runs the kernel on its three bf16 pieces (``bf16_split``) and
    sums in fp32: fp32-exact against fp32 weights that are exactly the dequantised ones. Forward only
    (the weights are frozen; no VJP).

    Args:
      lhs: [M, K] bf16 or fp32, rows sorted by group.
      values: float8_e4m3fn [G, K, N].
      scales: uint8 [G, K / group, N], E8M0 exponents (2^(e - 127)) of ``group`` consecutive inputs.
      group_sizes: int [G], sum <= M; or :class:`.tiles.RowGroups` (int32 [M]; pipeline and gemv schedules).
      out_dtype: default ``lhs.dtype``.
    """
    config = config or GroupedMatmulConfig()
    _check_mxfp8(lhs, values, scales, group_sizes, config)
    m = lhs.shape[0]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if config.schedule == "gemv":  # fp32 arithmetic on the CUDA cores: any lhs dtype in one call
        return gemv.kernel_call(group_sizes, m, lhs, ((values, scales),), out_dtype=out_dtype, config=config,
                                interpret=interpret)[0]
    pad = -m % 8 if m > 8 else 0  # as grouped_matmul: the TMA store's 8-row tiling
    m_pad = max(m + pad, config.block_m)
    pieces = bf16_split(lhs, 3) if lhs.dtype == jnp.float32 else (lhs.astype(jnp.bfloat16),)
    out = None
    for piece in pieces:
        piece = jnp.pad(piece, ((0, m_pad - m), (0, 0)))
        part = _kernel_call(group_sizes, m, piece, values, out_dtype=jnp.float32 if len(pieces) > 1 else out_dtype,
                            config=config, interpret=interpret, rhs_scales=scales)
        out = part if out is None else out + part
    return out[:m].astype(out_dtype)


def grouped_matmuls_mxfp8(lhs, weights, group_sizes, *, out_dtype=None, config=None, interpret=None) -> tuple:
    """:func:`grouped_matmul_mxfp8` of one ``lhs`` with each ``(values, scales)`` of ``weights`` (a tuple of
    pairs of one shape, e.g. an MLP's gate and up): a tuple of ``[M, N]``. On the gemv schedule they run
    as one launch (:func:`.gemv.kernel_call`); the MMA schedules run one call per weight. Not a jit
    boundary of its own: ``group_sizes`` known when tracing (a numpy array: a dense weight's one group)
    then give the gemv a constant schedule."""
    config = config or GroupedMatmulConfig()
    _check_mxfp8_weights("grouped_matmuls_mxfp8", lhs, weights, group_sizes, config)
    if config.schedule != "gemv":
        return tuple(grouped_matmul_mxfp8(lhs, v, s, group_sizes, out_dtype=out_dtype, config=config,
                                          interpret=interpret) for v, s in weights)
    return gemv.kernel_call(group_sizes, lhs.shape[0], lhs, tuple(weights), out_dtype=jnp.dtype(out_dtype or lhs.dtype),
                            config=config, interpret=interpret)


def gemv_launch_mxfp8(problems, *, out_dtype=None, interpret=None) -> tuple:
    """Several :func:`grouped_matmuls_mxfp8` calls on the gemv schedule as one launch: per problem
    ``(lhs [M, K], ((values, scales), ...), group_sizes, config)`` (each its own rows, groups, weights of one
    shape and ``config.split_k``), the tuple of its ``[M, N]`` outputs; the same values as one call each.
    A decode step's shared expert beside its routed experts (:func:`m3jax.moe.expert_mlps`)."""
    if not problems:
        raise ValueError("gemv_launch_mxfp8: no problems")
    jobs = []
    for lhs, weights, group_sizes, config in problems:
        if config.schedule != "gemv":
            raise ValueError(f"gemv_launch_mxfp8 runs the gemv schedule, not {config.schedule!r}")
        _check_mxfp8_weights("gemv_launch_mxfp8", lhs, weights, group_sizes, config)
        jobs.append(gemv.Problem(group_sizes, lhs.shape[0], lhs, tuple(weights), config.split_k))
    out_dtype = jnp.dtype(out_dtype or problems[0][0].dtype)
    return gemv.kernel_calls(jobs, out_dtype=out_dtype, interpret=interpret)


def dense_gemvs(lhs, weights, *, out_dtype=None, interpret=None) -> tuple:
    """``lhs [M, K] @ w`` for each bf16 ``w [K, N_i]`` of ``weights`` (any mix of widths), all in one gemv
    launch (:func:`.gemv.dense_problems`): fp32 arithmetic on the CUDA cores, an fp32 ``lhs`` taken as it
    is, the products summed in fp32 and rounded once to ``out_dtype`` (default ``lhs.dtype``). At most
    ``gemv.ROWS`` rows (:func:`.gemv.dense_unsupported_reason`). A decode step's attention projections."""
    if not weights:
        raise ValueError("dense_gemvs: no weights")
    m, k = check_dims("dense_gemvs", lhs=(lhs, "M K"))["M"], lhs.shape[1]
    for i, w in enumerate(weights):
        check_dims("dense_gemvs", lhs=(lhs, "M K"), **{f"weights[{i}]": (w, "K N")})
        if reason := gemv.dense_unsupported_reason(m, k, w.shape[1], w.dtype):
            raise ValueError(f"dense_gemvs cannot take lhs {lhs.shape} x weights[{i}] {w.shape}: {reason}")
    problems = gemv.dense_problems(lhs, weights)
    outs = gemv.kernel_calls([pr for pr, _ in problems], out_dtype=jnp.dtype(out_dtype or lhs.dtype),
                             interpret=interpret)
    result = [None] * len(weights)
    for (_, idx), out in zip(problems, outs):
        for i, o in zip(idx, out):
            result[i] = o
    return tuple(result)
