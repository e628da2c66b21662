"""Persistent, warp-specialised grouped GEMM (Hopper): ``GroupedMatmulConfig(schedule="warp_specialized")``.

Same contract as the pipeline kernel (:mod:`.kernel`: ``out[r] = lhs[r] @ rhs[g(r)]``, rows past the
groups' sum zero, bf16 / fp8 + E8M0 weights, ``transpose_rhs`` for the backward); what changes is
how the work is cut and who does what in a CTA.

* Group-aligned row tiles (:func:`aligned_schedule`). Group ``g``'s rows ``[start, end)`` are cut
  into tiles of ``block_m`` rows from ``start`` rounded down to a multiple of 8 (a TMA copy into
  the 8-row-tiled SMEM layout starts at such a row); only the first 7 and the last tile's rows can
  belong to other groups (multiplied, not stored). The pipeline kernel aligns tiles to multiples
  of ``block_m`` and visits a straddled tile once per group: at M3's prefill (32,768 rows over 128
  experts, ~256 rows each, 128-row tiles) that is ~383 tiles of MMA work for 256 tiles of rows,
  against ~2.5 tiles per expert (~320) here. A tile start is clamped to ``M - block_m`` so the box
  stays inside ``lhs`` (rows ``[lo, hi)`` still lie inside).
* Persistent grid. One CTA per SM (at most one per work item) loops (``plgpu.nd_loop``) over the
  work items (visit, N tile, K split), K split then N tile varying fastest, so the CTAs running
  together share an expert's weights and a row tile; the live count comes from the schedule, so
  a decode step does not walk the static bound of ``cdiv(M, block_m) + G`` visits.
* Warp specialisation (``plgpu.emit_pipeline_warp_specialized``). The last of three warpgroups
  issues the TMA copies (40 registers) and runs up to ``max_concurrent_steps`` K steps ahead of the
  consumers, across items (it loads the next item while the consumers store this one). Two
  consumer warpgroups share the CTA tile, each with its own fp32 register accumulators, ``wgmma``
  then ``wgmma_wait`` so a stage is released (``delay_release=1``) only after the MMAs that read it
  retired. ``wg_split="n"``: each owns half of the ``block_n`` columns (``[block_m, block_n / 2]``).
  ``wg_split="m"``: each owns ``block_m / 2`` rows and all ``block_n`` columns, as 64-row chunks with
  an accumulator each (:func:`chunk_rows`: the tile's chunks dealt to the consumers in turn), and a
  chunk's MMA is issued only where the chunk holds rows of the visit: the tensor cores multiply a
  group's rows at 64-row granularity while the CTA loads ``block_m``-row tiles. Each ``wgmma`` call
  commits a group of its own, so a step waits until only the groups it issued are in flight (two
  where both of a consumer's chunks hold rows, else one): the previous step's retired.
* The 256-row tiles (``block_m=256``, ``wg_split="m"``, ``block_n <= 128``: consumers of two
  ``[64, block_n]`` accumulators, 128 registers). One weight tile per K step serves up to 256 of an
  expert's rows, so an expert of up to ~256 rows streams its weights once per N tile, where 128-row
  visits streamed them once per visit and multiplied whole 128-row tiles. A group's last visit with
  at most ``SHORT_ROWS`` rows (:func:`short_rows`; at ~256 rows per expert, the few left past the
  first visit) runs a second pipeline whose lhs tile is ``SHORT_ROWS`` high, in the first rows of each
  stage's buffer (the pipelines share their buffers and barriers; each visit's drains them), so it
  does not load 256 rows for a few.
* The 384-row tiles (``block_m=384``, ``block_n <= 128``: consumers of three ``[64, block_n]``
  accumulators, 192 registers of the 232 a consumer gets beside a 40-register producer). Past ~256 rows
  per expert (M3's 8,192-token prefill), a 256-row tile leaves about half of the experts a second visit
  for their last few rows, and that visit streams the expert's weights again; a 384-row tile takes an
  expert of up to ~380 rows in one visit, so its weights stream once, and the MMAs still skip the
  64-row chunks without rows.
* Clusters (``cluster=2``, opt-in). The grid runs over two-CTA clusters; a cluster's CTAs take
  adjacent N tiles of one visit, and the lhs tile's BlockSpec is collective over the cluster: each CTA
  loads half of it by TMA multicast into both (the consumed barriers become cluster barriers). On the
  256-row tiles the lhs tile is a K step's larger load.
* MXFP8 weights. Each consumer dequantises its columns of the fp8 tile (``tiles.dequantize_tile``;
  ``wg_split="m"``: all of them, into its own tiles: no barrier between the consumers) into its own
  pair of bf16 SMEM tiles, then issues the MMA, so its MMA of the previous step and the other
  consumer's MMA can run during the conversion; with ``wg_split="m"`` a consumer without rows in the
  visit converts nothing. The fp8 tile is swizzled by a consumer's column count (64 columns: 64
  bytes; 128 or more: 128), so each consumer's columns are whole swizzle atoms down to
  ``block_n=128``.
* Barriers (MXFP8). Pallas puts a warpgroup barrier before and after every SMEM store by default; the
  conversion stores its bf16 tile in two pieces per step (one per scale group), so a consumer met five
  barriers per K step where one is needed: ``commit_smem``'s, after the whole tile, which every thread
  must reach before the MMA reads the tile. With ``EXPLICIT_BARRIERS`` the automatic ones are off
  (``unsafe_no_auto_barriers``). What they guarded is covered without them: a thread's fp8 and scale
  loads of step ``kk`` finish before that step's ``commit_smem``, which comes before the slot's release
  (one step later, ``delay_release=1``); the bf16 buffer a step overwrites was last read by the MMA of
  two steps before, retired by each thread's ``wgmma_wait`` of the step between. The epilogue gets its barrier back in
  place: its TMA stores are issued by one thread, so only that thread's wait knows a staging tile is
  free, and a ``commit_smem`` after the wait holds the others until it does.
* No branch around the epilogue. With the wgmmas and the epilogue under a "has rows" test (always
  true with ``wg_split="n"``), ptxas reports the wgmmas serialized (C7511, "insufficient register
  resources", beside C7517, a ``warpgroup.wait`` injected where the skipping path meets the next item)
  at every tile, bf16 and MXFP8, and the MXFP8 kernel takes the MMAs' time plus the conversion's;
  without the test ptxas reports neither (benchmarks/RESULTS.md#gmm-tile-figures). What it needs is
  the accumulators read under no branch: with ``wg_split="m"``'s wgmmas under their chunk's test and
  the epilogue under none, ptxas 13.0 on the sm_90a PTX reports neither message, and the SASS issues
  a step's HGMMAs back to back, its waits for all groups only at the epilogue. A chunk without rows
  stores nothing (its piece of ``[lo, hi)`` is empty).
* Store. Each consumer casts its accumulator into its own SMEM tile, 64 rows x 128 columns at a time
  (the SMEM saved is a fourth pipeline stage at ``block_m=128, block_n=256``), and TMA-stores the
  piece's rows of ``[lo, hi)`` as a sum of powers of two (at most 7 conditional copies per piece;
  the visits of one row tile own disjoint rows, so they never race). Zero-group visits store
  zeros, loading nothing.
* Split-K (``split_k > 1``, decode). Each item contracts ``K / split_k``; the items write fp32
  partials ``[split_k, M, N]`` that XLA sums. A decode step has a few rows per expert: its
  (visit, N tile) items alone leave SMs idle, and the weight stream (the bytes floor) needs all of
  them reading.

Hopper only: the consumers issue wgmma (``unsupported_reason`` refuses a tcgen05 target).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import current_target, mosaic_kernel, pl, plgpu
from m3jax.pallas._common import swizzle_transforms
from m3jax.pallas.grouped_matmul import tiles
from m3jax.pallas.grouped_matmul.tiles import deal_visits, dequantize_tile, group_rows

CONSUMERS = 2  # consumer warpgroups; the producer is warpgroup CONSUMERS (the last one)
CHUNK_ROWS = 64  # wgmma's M: with wg_split="m" a consumer multiplies (or skips) its rows this many at a time
# wg_split="m", block_m=256: a visit of at most this many rows (a group's last) loads an lhs tile this high
SHORT_ROWS = 128
PRODUCER_REGISTERS = 40
# a consumer's fp32 accumulator registers per thread at most: of the 232 each consumer gets beside the
# producer's 40 (emit_pipeline_warp_specialized's split of 512), 40 are left for addresses and the loop
ACC_REGISTERS = 192
ROW_ALIGN = 8  # a row tile starts at a multiple of this (the SMEM tiling's rows)
EPI_ROWS, EPI_COLS = 64, 128  # a consumer's output staging tile; larger accumulators are stored in pieces
# MXFP8: Pallas's automatic warpgroup barriers around SMEM stores off (``unsafe_no_auto_barriers``), the
# kernel placing the ones it needs (see the module docstring)
EXPLICIT_BARRIERS = True


def aligned_schedule(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """(int32 [V, 4]: per visit (group, row0, lo, hi), rows ``[lo, hi)`` of the tile at ``row0``; int32
    [1]: how many visits are live (they come first, group by group).

    Group ``g``'s tiles start at its first row rounded down to a multiple of 8 (a TMA copy into the
    8-row-tiled SMEM layout starts at such a row) and step by ``block_m``. Group ``G`` is the zero
    group (rows ``[sum, m)``). Each of the G + 1 groups has ``cdiv(size + 7, block_m)`` visits at
    most, hence the static bound V.
    """
    g = group_sizes.shape[0]
    starts, ends = group_rows(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    base = starts // ROW_ALIGN * ROW_ALIGN
    count = jnp.where(ends > starts, (ends - base + block_m - 1) // block_m, 0)
    grp, ordinal, live = deal_visits(count, -(-(m + (g + 1) * (ROW_ALIGN - 1)) // block_m) + g + 1)
    row0 = base[grp] + ordinal * block_m
    lo = jnp.maximum(starts[grp], row0)
    hi = jnp.minimum(row0 + block_m, ends[grp])
    zero = jnp.zeros_like(grp)
    sched = jnp.stack([grp] + [jnp.where(live, x, zero) for x in (row0, lo, hi)], axis=1)
    return sched, jnp.sum(count, keepdims=True)


def consumer_tile(config) -> tuple[int, int]:
    """(rows, columns) of one consumer warpgroup's accumulators (with wg_split="m", ``rows / CHUNK_ROWS``
    of them, :func:`chunk_rows`)."""
    if config.wg_split == "m":
        return config.block_m // CONSUMERS, config.block_n
    return config.block_m, config.block_n // CONSUMERS


def chunk_rows(config, wg, rows: int) -> list:
    """The first tile row of each of consumer ``wg``'s accumulators in a ``rows``-row tile: with
    wg_split="m" the tile's 64-row chunks dealt to the consumers in turn (consumer w holds chunks w,
    w + 2, ...), so a visit whose rows fill only the first chunks still keeps both consumers
    multiplying; with "n" one accumulator of all the rows."""
    if config.wg_split != "m":
        return [0]
    return [pl.multiple_of((CONSUMERS * i + wg) * CHUNK_ROWS, CHUNK_ROWS)
            for i in range(rows // CONSUMERS // CHUNK_ROWS)]


def short_rows(config) -> int | None:
    """The lhs tile's rows of a short visit (the schedule's last visit of a group, holding at most that
    many rows), or None where every visit loads ``block_m`` rows."""
    return SHORT_ROWS if config.wg_split == "m" and config.block_m > SHORT_ROWS else None


def unsupported_reason(k: int, n: int, config) -> str | None:
    """This schedule's own limits, bf16 and MXFP8 weights alike (the caller checks the shared ones: block_k,
    K, N)."""
    bm, bn = config.block_m, config.block_n
    if current_target().mma != "wgmma":
        return "schedule='warp_specialized' issues wgmma (Hopper only)"
    if config.wg_split not in ("n", "m"):
        return f"wg_split={config.wg_split!r} must be 'n' or 'm'"
    rows, cols = consumer_tile(config)
    if config.wg_split == "m":
        if bm not in (128, 256, 384):
            return f"wg_split='m' needs block_m=128, 256 or 384 (two consumers of 64, 128 or 192 rows), not {bm}"
        if bn % 64 or not 64 <= bn <= 256:
            return f"block_n={bn} must be a multiple of 64 in [64, 256] with wg_split='m'"
    elif bm not in (64, 128):
        return f"block_m={bm} must be 64 or 128 with wg_split='n' (256, 384: wg_split='m')"
    elif bn % (64 * CONSUMERS) or not 128 <= bn <= 512:
        return f"block_n={bn} must be a multiple of 128 in [128, 512] (two consumer warpgroups of >= 64 columns)"
    if rows * cols > ACC_REGISTERS * 128:
        return (f"a consumer's {rows} x {cols} fp32 accumulator would need more than {ACC_REGISTERS} registers per "
                f"thread (block_m={bm}, block_n={bn}, wg_split={config.wg_split!r})")
    if config.split_k < 1 or k % (config.split_k * config.block_k):
        return f"K={k} must be a multiple of split_k * block_k = {config.split_k} * {config.block_k}"
    if config.cluster not in (1, 2):
        return f"cluster={config.cluster} must be 1 or 2"
    if (n // bn) % config.cluster:
        return (f"N / block_n = {n // bn} N tiles must be a multiple of cluster={config.cluster} (a cluster's CTAs "
                "take adjacent N tiles)")
    return None


def _stages(k_steps: int, config, rhs_itemsize: int, scale_rows: int, part_itemsize: int) -> int:
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    stage = bm * bk * 2 + bk * bn * rhs_itemsize + scale_rows * bn
    rows, cols = consumer_tile(config)
    fixed = CONSUMERS * min(rows, EPI_ROWS) * min(cols, EPI_COLS) * part_itemsize  # output staging tiles
    if scale_rows:
        fixed += CONSUMERS * 2 * bk * cols * 2  # each consumer's two bf16 weight tiles
    # 1 KiB for the barriers and alignment (lowering measured 80 bytes beyond the buffers; it refuses overflow)
    fit = (current_target().smem_bytes - 1024 - fixed) // stage
    return max(1, min(config.max_concurrent_steps, fit, k_steps))


def _store_ladder(o_smem, dst, *, row0, lo, hi, col0, rows, cols):
    """TMA rows [lo, hi) of the ``rows``-row tile at row0 as a sum of powers of two (largest first);
    nothing when hi <= lo."""
    start, count = lo - row0, jnp.maximum(hi - lo, 0)
    size = rows
    while size:
        @pl.when((count & size) != 0)
        def _(start=start, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)], dst.at[pl.ds(row0 + start, size), pl.ds(col0, cols)])

        start = start + (count & size)
        size //= 2


def kernel_call(group_sizes, m, lhs, rhs, *, out_dtype, config, transpose_rhs=False, interpret=None, rhs_scales=None):
    """``out [M_rows, N]`` (``lhs [M_rows, K]``, M_rows >= block_m; rows >= m unspecified; with split-K
    ``[m, N]``) as :func:`.kernel._kernel_call`, on this schedule; ``m`` is the rows the groups cover."""
    m_rows, k = lhs.shape
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk, split = config.block_m, config.block_n, config.block_k, config.split_k
    bh, bw = consumer_tile(config)
    epi_r, epi_c = min(bh, EPI_ROWS), min(bw, EPI_COLS)
    n_tiles, k_part = n // bn, k // split
    mxfp8 = rhs_scales is not None
    group = k // rhs_scales.shape[1] if mxfp8 else 0
    explicit_barriers = mxfp8 and EXPLICIT_BARRIERS
    part_dtype = jnp.dtype(jnp.float32 if split > 1 else out_dtype)
    steps = _stages(k_part // bk, config, rhs.dtype.itemsize, bk // group if mxfp8 else 0, part_dtype.itemsize)
    delay = 1 if steps > 1 else 0
    sched, live = aligned_schedule(group_sizes, m, bm)
    cl = config.cluster  # a cluster's CTAs take adjacent N tiles of one visit: per_visit counts clusters' items
    per_visit = n_tiles // cl * split
    n_clusters = min(current_target().num_sms // cl, sched.shape[0] * per_visit)

    # MXFP8: the MMA's operands are the lhs tile and the converted weight tile, which Mosaic GPU wants
    # swizzled alike: as the conversion's plan has the weights
    plan = tiles.tile_plan(bw) if mxfp8 else None
    short = short_rows(config)
    lhs_transforms = plan.bf16_transforms if mxfp8 else swizzle_transforms(bk)
    if transpose_rhs:
        rhs_spec = plgpu.BlockSpec((bn, bk), lambda kk: (0, kk), transforms=swizzle_transforms(bk), delay_release=delay)
    else:
        # swizzled by the columns one consumer reads, so its slice is whole swizzle atoms; fp8: as the
        # conversion's plan for those columns has it
        rhs_spec = plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), delay_release=delay,
                                   transforms=plan.fp8_transforms if mxfp8 else swizzle_transforms(bw))
    weight_specs = [rhs_spec]
    if mxfp8:  # read into registers by the consumer, released with the step's other buffers
        weight_specs.append(plgpu.BlockSpec((bk // group, bn), lambda kk: (kk, 0), delay_release=delay))

    def pipeline(step, context, rows=bm):
        """The K loop of a ``rows``-row lhs tile (block_m, or a short visit's SHORT_ROWS)."""
        lhs_spec = plgpu.BlockSpec((rows, bk), lambda kk: (0, kk), delay_release=delay, transforms=lhs_transforms,
                                   collective_axes=("cluster",) if cl > 1 else ())  # multicast, half by each CTA
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_part // bk,), memory_registers=PRODUCER_REGISTERS, in_specs=[lhs_spec, *weight_specs],
            wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=steps, compute_context=context)

    def body(sched_ref, live_ref, lhs_ref, rhs_ref, *refs):
        scale_ref, out_ref = refs if mxfp8 else (None, refs[0])
        operands = [lhs_ref, rhs_ref.at[0]] + ([scale_ref.at[0]] if mxfp8 else [])

        def ignore(*_, **__):  # the allocations depend on the specs only
            return None

        def scoped(allocs, o_smem, w_smem=None):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((live_ref[0] * per_visit,), collective_axes="sm")
            def _item(info):
                (item,) = info.index
                v, rest = lax.div(item, per_visit), lax.rem(item, per_visit)
                ni, ks = lax.div(rest, split), lax.rem(rest, split)
                if cl > 1:
                    ni = ni * cl + lax.axis_index("cluster")
                grp, row0, lo, hi = (sched_ref[v, i] for i in range(4))
                col0, k0 = ni * bn, ks * k_part
                dst = out_ref.at[ks] if split > 1 else out_ref
                by_rows = config.wg_split == "m"
                # this consumer's columns of the CTA tile (whole swizzle atoms)
                c0 = 0 if by_rows else pl.multiple_of(wg * bw, bw)
                acc_h = CHUNK_ROWS if by_rows else bh

                def inside(rows):  # the tile start kept inside lhs (m_rows and rows are multiples of 8)
                    return pl.multiple_of(jnp.minimum(row0, m_rows - rows), ROW_ALIGN)

                def when(active, fn):
                    return fn() if active is None else pl.when(active)(fn)

                def store(tile0, pieces):
                    """(first tile row, [rows, bw] values) per accumulator, a staging tile at a time."""
                    o = o_smem.at[wg]
                    for r0, values in pieces:
                        for r in range(0, values.shape[0], epi_r):
                            for c in range(0, bw, epi_c):
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous piece left the tile
                                if explicit_barriers:  # ... which only the thread that issued its copy knows
                                    plgpu.commit_smem()
                                o[...] = values[r : r + epi_r, c : c + epi_c].astype(part_dtype)
                                plgpu.commit_smem()
                                base = tile0 + r0 + r
                                _store_ladder(o, dst, row0=base, lo=jnp.maximum(lo, base),
                                              hi=jnp.minimum(hi, base + epi_r), col0=col0 + c0 + c,
                                              rows=epi_r, cols=epi_c)

                def visit(rows, tile_allocs):
                    """The visit's K loop on a ``rows``-row lhs tile; [lo, hi) lies inside it."""
                    tile0 = inside(rows)
                    acc_rows = chunk_rows(config, wg, rows)
                    # with wg_split="m": whether each 64-row chunk holds any of [lo, hi)
                    actives = [(tile0 + r < hi) & (tile0 + r + acc_h > lo) for r in acc_rows] if by_rows else [None]

                    def step(idx, a_smem, b_smem, *rest):
                        accs = rest[-1]
                        (kk,) = idx
                        cols = pl.ds(c0, bw)
                        if mxfp8:
                            w = w_smem.at[wg, lax.rem(kk, 2)]  # step kk - 2's MMA, its last reader, retired
                            # a consumer without rows in this visit converts nothing
                            when(functools.reduce(jnp.logical_or, actives) if by_rows else None,
                                 lambda: dequantize_tile(b_smem.at[:, cols], rest[0].at[:, cols], w, group))
                        elif transpose_rhs:
                            w = b_smem.at[cols].transpose((1, 0))
                        else:
                            w = b_smem.at[:, cols]
                        for acc_ref, r, active in zip(accs, acc_rows, actives):
                            a = a_smem.at[pl.ds(r, acc_h)] if by_rows else a_smem
                            when(active, lambda acc_ref=acc_ref, a=a: plgpu.wgmma(acc_ref, a, w))
                        # each wgmma call commits a group of its own: retire step kk - 1's (delay 1), leaving
                        # in flight the groups issued here, one per chunk with rows (with a tile clamped to
                        # lhs's end, the rows may start in any chunk); a consumer without rows issued none
                        # in this visit, and one group left in flight is then none of it
                        if len(accs) == 1:
                            plgpu.wgmma_wait(delay)
                        else:
                            issued = sum(a.astype(jnp.int32) for a in actives)

                            def wait(groups):
                                plgpu.wgmma_wait(groups * delay)

                            for n in range(1, len(accs) + 1):
                                pl.when(jnp.maximum(issued, 1) == n)(functools.partial(wait, n))
                        return accs

                    def context(run):
                        # the store reads the accumulators under no branch: with one (a consumer's "has rows"
                        # test) ptxas serialized the wgmmas (module docstring); a chunk without rows stores none
                        def acc_scope(*accs):
                            run(accs)
                            store(tile0, [(r, acc_ref[...]) for r, acc_ref in zip(acc_rows, accs)])

                        pl.run_scoped(acc_scope, *[plgpu.ACC((acc_h, bw), jnp.float32) for _ in acc_rows])

                    a = lhs_ref.at[pl.ds(tile0, rows), pl.ds(k0, k_part)]
                    if transpose_rhs:
                        b = rhs_ref.at[grp, pl.ds(col0, bn), pl.ds(k0, k_part)]
                    else:
                        b = rhs_ref.at[grp, pl.ds(k0, k_part), pl.ds(col0, bn)]
                    args = [a, b]
                    if mxfp8:
                        args.append(scale_ref.at[grp, pl.ds(k0 // group, k_part // group), pl.ds(col0, bn)])
                    pipeline(step, context, rows)(*args, allocations=tile_allocs)

                if short is None:
                    pl.when(grp < g)(lambda: visit(bm, allocs))
                else:
                    # a short visit's lhs tile: the first rows of each stage's block_m-row buffer, the
                    # pipeline's other buffers and barriers shared (each visit's pipeline drains them)
                    lhs_smem, *weight_smem = allocs["flat_in_smem_refs"]
                    short_allocs = dict(allocs, flat_in_smem_refs=[lhs_smem.at[:, pl.ds(0, short)], *weight_smem])
                    is_short = hi - row0 <= short  # the schedule's row0: a tile's rows before any clamping
                    pl.when((grp < g) & ~is_short)(lambda: visit(bm, allocs))
                    pl.when((grp < g) & is_short)(lambda: visit(short, short_allocs))

                @pl.when((grp == g) & (wg < CONSUMERS))
                def _():
                    store(inside(bm), [(r, jnp.zeros((acc_h, bw), part_dtype)) for r in chunk_rows(config, wg, bm)])

            plgpu.wait_smem_to_gmem(0)  # the last stores, before the CTA exits

        scratch = {"allocs": pipeline(ignore, ignore).get_allocations(*operands),
                   "o_smem": plgpu.SMEM((CONSUMERS, epi_r, epi_c), part_dtype)}
        if mxfp8:
            scratch["w_smem"] = plgpu.SMEM((CONSUMERS, 2, bk, bw), jnp.bfloat16, transforms=plan.bf16_transforms)
        pl.run_scoped(scoped, **scratch, collective_axes="wg")

    out_shape = (split, m_rows, n) if split > 1 else (m_rows, n)
    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=jax.ShapeDtypeStruct(out_shape, part_dtype),
        grid=(n_clusters,),
        grid_names=("sm",),
        **({"cluster": (cl,), "cluster_names": ("cluster",)} if cl > 1 else {}),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=explicit_barriers),
    )
    out = kern(sched, live, lhs, rhs, *((rhs_scales,) if mxfp8 else ()))
    # the partials' live rows only (a decode step's few rows sit in a block_m-row padded tile)
    return out[:, :m].sum(0).astype(out_dtype) if split > 1 else out
