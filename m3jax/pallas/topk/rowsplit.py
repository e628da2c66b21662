"""Mosaic GPU kernel: MSA top-k block selection for few, long rows (decode), one CTA per row.

Why a second kernel. The block-major kernel (:mod:`.kernel`) gives each row to one thread, which
inserts all ``nb`` blocks one after the other: right for prefill (thousands of rows fill the GPU),
but a decode step has ``B * Hi * Q`` rows (4 at batch 1), so one warpgroup of one SM would walk
an 8,192-long chain. Here the work of one row is split across the 128 threads of a warpgroup.

Design (Hopper): grid = one CTA (one warpgroup) per row (row = one (batch, index head, query)).

* Load. The row's scores, padded with ``-inf`` to ``nb_pad`` (a multiple of 128) outside the
  kernel, are viewed as ``[nb_pad / 128, 128]`` and copied to SMEM by one TMA (32 KiB at 8,192
  blocks = 1M tokens; box dims are limited to 256, hence ``nb <= 32,768``). :func:`select_blocks_rows`
  loads the decode scoring kernel's rows as that kernel wrote them instead (no pad, no transpose in
  XLA): whatever lies after the row's own block counts as ``-inf``, and the row's factor multiplies
  each score as it is loaded.
* Per-thread top-k. Thread ``i`` loads column ``i`` of each SMEM row (``WG_STRIDED`` layout), i.e.
  it owns blocks ``{c * 128 + i}``, and inserts them in increasing id into a sorted list held in
  registers (``topk`` values + ``topk`` ids; ``select.forced_candidate`` and ``select.insert``, so
  ties go to the lower id and forced blocks get the reference priorities). SMEM rows wholly past
  the row's causal limit (all ``-inf`` by the score contract) are not visited. The loop takes
  ``ROWS_PER_STEP`` SMEM rows per step (then the rest one by one), so the loads and forced ranks of a
  step's rows, which do not depend on the lists, issue ahead of the insertions.
* Short lists first (``lane_list``, default :data:`LANE_LIST` = 4 entries, when below ``topk``). The
  insertion costs ``5 k`` operations per block for a list of ``k``, so each thread first keeps only
  ``lane_list`` entries and the largest value its list lost (the evicted last entry or the rejected
  block: ``min(x, last)``, two more operations). The lists (padded to ``kp``) and the lost values go
  through the merge below; the answer is exact when the largest lost value is below the k-th kept
  one, strictly, or ``-inf`` (such blocks never enter). Otherwise -- some thread's blocks
  ``{c * 128 + i}`` hold more than ``lane_list`` of the top-k, or a lost value ties the k-th -- the
  whole selection runs again with full lists, one SMEM row a loop step (a warpgroup-uniform branch
  on two SMEM scalars; the rare path is kept small, as Mosaic's lowering time grows faster than the
  kernel's IR). The top-k of a row spread over 128 threads rarely puts 5 of its blocks in one thread.
* Tree merge, 7 rounds (``log2 128``). In the round of stride ``s`` every thread writes its list
  to SMEM (``[kp, 192]`` values and ids, double buffered so that a round's writes never overtake
  the previous round's reads), the warpgroup synchronises, and thread ``i`` reads the list of
  thread ``i + s`` with a shifted contiguous load. Two descending lists are merged into their top
  ``kp`` by a bitonic step: ``C_j = better(A_j, B_{kp-1-j})`` (a bitonic sequence holding the top
  ``kp``) then ``log2 kp`` half-cleaner levels. ``better`` is the total order of the selection
  (value descending, then id ascending), so ties still go to the lower id; ``kp`` = ``topk``
  rounded up to a power of two (extra ``(-inf, -1)`` slots). Only the threads with
  ``i % 2s == 0`` hold meaningful lists after a round; the others compute garbage (reading
  columns 128..191 or stale lists) that no meaningful thread ever reads.
* Synchronisation. A generic SMEM store read back by other threads of the warpgroup needs a
  ``bar.sync`` of the warpgroup's named barrier between the two; ``plgpu.commit_smem`` is that
  barrier (after a ``fence.proxy.async``, which the final TMA store needs anyway). The kernel runs
  with ``unsafe_no_auto_barriers``: Pallas would otherwise wrap every vector store in two more
  barriers. GPU interpret mode simulates a warpgroup as one thread, so its race detector cannot
  see a missing barrier here (the kernel still passes with none); ``benchmarks/msa_decode.py``
  checks the ids on the device.
* Output. Thread 0 ends with the row's answer; its ids go through SMEM (scalar reads of its
  column) to one int32 row of ``topk`` rounded up to 4 (a TMA row is a multiple of 16 bytes) per
  CTA.

Output order: forced blocks first (own, own-1, ..., init sinks), then descending score, ties to the
lower block id (``-0.0`` ties ``+0.0``), ``-1`` right padding, i.e. exactly the order of
``m3jax.msa.select_blocks``.

Cost per row, in instructions per warp (the 4 warps run on the 4 SM sub-partitions, ~1 issue per
cycle each; the insertions and the compare-exchanges of one level are independent, so issue, not
latency, bounds them): ``nb / 128`` insertions of ``~5 topk + 15`` ops, then 7 merge rounds of
``4 kp`` SMEM accesses, ``7 kp + 9 (kp / 2) log2 kp`` ops and one barrier. At top-16: ~95 per
insertion and ~470 per round, so nb = 1,024 (128K tokens) is ~0.8K + 3.3K and nb = 8,192 (1M)
~6.1K + 3.3K, i.e. ~2.5 and ~5.5 us at 1.7 GHz, plus ~1 us for the TMA of the row (4 / 32 KiB)
and the output store. Rows run on separate SMs: up to 132 rows cost the same as one.

Measured, the counts above are not the whole story: with one SMEM row per step the 1M row took 11 us
and the 128K row 5 us. Dealing a row's SMEM rows to 2 or 4 warpgroups of the CTA (each inserting a
half or a quarter, the lists handed to the first through SMEM) left the 1M row at the time of one
warpgroup with 2 and made it 4 % slower with 4, and made 128K rows 12 % and 30 % slower
(benchmarks/RESULTS.md#decode-2026-12-06e). More warpgroups share the same four schedulers of the SM,
so they add no issue slots. Eight rows per step (loads and forced ranks that need not wait for the
previous insertions) is faster than one, at 1M and at 128K: benchmarks/RESULTS.md#topk-rows-per-step
(rows padded to whole steps) and #decode-2026-12-06-h200 (this loop: whole steps, then single rows).
With full lists, the 1M row's time is about half insertions, a third merge rounds, the rest the row's
load and the output; the 128K row's is nearly all merge (benchmarks/RESULTS.md#decode-2026-12-07).

Blackwell: nothing here uses the MMA, TMEM or clusters, so the kernel runs unchanged (148 SMs, the
same SMEM budget).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3jax.pallas._backend import current_target, mosaic_kernel, pl, plgpu
from m3jax.pallas.topk import select

NEG_INF = float("-inf")
LANES = 128  # one warpgroup; thread i owns blocks {c * 128 + i}
MERGE_ROUNDS = 7  # log2(LANES)
# Columns of a merge buffer: the shifted read of the widest stride (64) ends at column 64 + 127.
MERGE_COLS = LANES + LANES // 2
MAX_SMEM_ROWS = 256  # TMA box dims are <= 256: nb <= 256 * 128 blocks
SMEM_RESERVED = 8 * 1024  # Pallas' own SMEM (reduction scratch, barriers, alignment)
# SMEM rows inserted per loop step (select_blocks' rows_per_step): the measured best of 1, 2, 4 and 8
# (benchmarks/RESULTS.md#topk-rows-per-step).
ROWS_PER_STEP = 8
# Entries of each thread's first lists (select_blocks' lane_list; the top-k's own length when it is not
# larger): a thread then inserts at a fraction of the cost, and the full lists run only when the short
# ones may have lost a block of the top-k.
LANE_LIST = 4


def unsupported_reason(nb: int, topk: int) -> str | None:
    """Why one CTA cannot take a row of ``nb`` blocks at this ``topk`` (None when it can)."""
    if not 1 <= topk <= LANES:
        return f"topk {topk} must be in [1, {LANES}]"
    n_rows = -(-nb // LANES)
    if n_rows > MAX_SMEM_ROWS:
        return f"nb {nb} > {MAX_SMEM_ROWS * LANES} blocks: one TMA box per row cannot hold it"
    kp = 1 << (topk - 1).bit_length()
    smem = n_rows * LANES * 4 + 2 * (2 * kp + 1) * MERGE_COLS * 4 + LANES * 4  # scores, merge lists, output
    if smem > current_target().smem_bytes - SMEM_RESERVED:
        return f"nb {nb} and topk {topk} need {smem} bytes of SMEM per CTA"
    return None


def _layout():
    return plgpu.Layout.WG_STRIDED((LANES,), 1)


def _better(av, ai, bv, bi):
    """The selection's total order: higher value first, equal values (-0.0 == +0.0) to the lower id."""
    return (av > bv) | ((av == bv) & (ai < bi))


def _merge(a_vals, a_ids, b_vals, b_ids):
    """Top ``kp`` of two descending lists of ``kp`` (a power of two) entries, descending (bitonic merge)."""
    kp = len(a_vals)
    vals, ids = [], []
    for j in range(kp):
        g = _better(a_vals[j], a_ids[j], b_vals[kp - 1 - j], b_ids[kp - 1 - j])
        vals.append(jnp.where(g, a_vals[j], b_vals[kp - 1 - j]))
        ids.append(jnp.where(g, a_ids[j], b_ids[kp - 1 - j]))
    d = kp // 2
    while d:
        for j in range(kp):
            if j & d:
                continue
            g = _better(vals[j], ids[j], vals[j + d], ids[j + d])
            vals[j], vals[j + d] = jnp.where(g, vals[j], vals[j + d]), jnp.where(g, vals[j + d], vals[j])
            ids[j], ids[j + d] = jnp.where(g, ids[j], ids[j + d]), jnp.where(g, ids[j + d], ids[j])
        d //= 2
    return tuple(vals), tuple(ids)


def _kernel_call(scores, q_pos, heads: int, *, block_size, topk, local_blocks, init_blocks, force_in, force_out,
                 rows_per_step, row_stride=None, unscale=None, num_blocks=None, lane_list=None, interpret=None):
    """int32 [R, topk rounded up to 4] (first ``topk`` columns valid), R = B * heads * Q rows
    (b * heads + h) * Q + t, from fp32 scores [B * row_stride, nb_pad / 128, 128], row (b, h, t) at
    ``b * row_stride + h * Q + t`` (``row_stride=None``: heads * Q, the rows packed), and the positions
    q_pos [B, Q] (read per row in the kernel: no XLA broadcast launch before it). With ``row_stride``
    (the scoring kernel's rows read in place) the blocks after a row's own block are taken as -inf
    whatever they hold, and ``unscale`` fp32 [B, heads * Q] (or None) multiplies each row's scores
    first; ``num_blocks``: only the first ``ceil(num_blocks / 128)`` rows of 128 are loaded. ``rows_per_step``
    SMEM rows are inserted per step of the main loop, then the visible rows left one per step."""
    n_rows = scores.shape[1] if num_blocks is None else -(-num_blocks // LANES)
    u = rows_per_step
    b, q = q_pos.shape
    hq = heads * q
    r = b * hq
    in_place = row_stride is not None
    kp = 1 << (topk - 1).bit_length()
    lane_list = LANE_LIST if lane_list is None else lane_list
    out_cols = -(-topk // 4) * 4  # a TMA row is a multiple of 16 bytes

    def body(s_ref, pos_ref, *refs):
        scale_ref = refs[0] if unscale is not None else None
        out_ref, s_smem, v_buf, i_buf, o_smem, bar = refs[unscale is not None:]
        row = jax.lax.axis_index("row")
        bi, c = jax.lax.div(row, hq), jax.lax.rem(row, hq)
        src = s_ref.at[bi * row_stride + c if in_place else row]
        plgpu.copy_gmem_to_smem(src if n_rows == scores.shape[1] else src.at[pl.ds(0, n_rows)], s_smem, bar.at[0])
        pos = pos_ref[bi, jax.lax.rem(row, q)]
        own = jnp.floor_divide(pos, block_size)
        nvis = jnp.clip(own + 1, 0, n_rows * LANES)
        scale = scale_ref[bi, c] if scale_ref is not None else None
        lane = plgpu.broadcasted_iota(jnp.int32, (LANES,), 0, layout=_layout())
        empty_v = plgpu.layout_cast(jnp.full((LANES,), NEG_INF, jnp.float32), _layout())
        empty_i = plgpu.layout_cast(jnp.full((LANES,), -1, jnp.int32), _layout())
        plgpu.barrier_wait(bar.at[0])

        def candidate(c):
            return select.smem_candidate(s_smem.at[c], pos, c * LANES + lane, layout=_layout(),
                                         block_size=block_size, local_blocks=local_blocks, init_blocks=init_blocks,
                                         force_in=force_in, force_out=force_out, scale=scale,
                                         own=own if in_place else None)

        def one(c, carry):
            vals, ids, drop = carry
            x = candidate(c)
            if drop is not None:  # the value this insertion loses: the list's last, or x itself
                drop = jnp.maximum(drop, jnp.minimum(x, vals[-1]))
            return (*select.insert(vals, ids, x, c * LANES + lane), drop)

        def several(steps: int):
            def body(c, carry):
                # ``steps`` rows a step: their loads and forced ranks do not depend on the lists, so they can
                # be issued ahead of the previous rows' insertions (benchmarks/RESULTS.md#topk-rows-per-step).
                for t in range(steps):
                    carry = one(c * steps + t, carry)
                return carry

            return body

        rows_vis = -(-nvis // LANES)

        def store(slot, vals, ids, drop):
            for t in range(kp):
                v_buf[slot, t, pl.ds(0, LANES)] = vals[t]
                i_buf[slot, t, pl.ds(0, LANES)] = ids[t]
            if drop is not None:
                v_buf[slot, kp, pl.ds(0, LANES)] = drop
            # fence + warpgroup bar.sync: the stores are visible to the other threads' loads after it.
            plgpu.commit_smem()

        def merge_round(rnd, carry):
            # Round rnd writes slot rnd % 2, last read in round rnd - 2: every thread finished those
            # reads before the barrier of round rnd - 1.
            slot, stride = rnd % 2, jnp.left_shift(1, rnd)
            store(slot, *carry)
            partner = ([plgpu.load(v_buf.at[slot, t, pl.ds(stride, LANES)]) for t in range(kp)],
                       [plgpu.load(i_buf.at[slot, t, pl.ds(stride, LANES)]) for t in range(kp)])
            drop = carry[2]
            if drop is not None:
                drop = jnp.maximum(drop, plgpu.load(v_buf.at[slot, kp, pl.ds(stride, LANES)]))
            return (*_merge(*carry[:2], *partner), drop)

        def select_row(length: int, track: bool, steps: int):
            """Lists of ``length`` per thread, ``steps`` SMEM rows a loop step, merged into thread 0's top
            ``kp``, left in the final slot (with ``track``, each list also keeps the largest value it
            lost, and row kp the largest any list lost)."""
            drop = empty_v if track else None
            carry = ((empty_v,) * length, (empty_i,) * length, drop)
            carry = jax.lax.fori_loop(0, rows_vis // steps, several(steps), carry)
            vals, ids, drop = jax.lax.fori_loop(rows_vis // steps * steps, rows_vis, one, carry)
            vals, ids = vals + (empty_v,) * (kp - length), ids + (empty_i,) * (kp - length)
            # A loop, not 7 unrolled rounds: Mosaic's layout inference is superlinear in the IR size
            # (100+ s to lower the unrolled kernel). The partner loads carry no layout cast, so their
            # layouts follow from the merge instead of one search step each.
            carry = jax.lax.fori_loop(0, MERGE_ROUNDS, merge_round, (vals, ids, drop))
            store(MERGE_ROUNDS % 2, *carry)

        if lane_list < topk:
            # Short lists first. No block a list lost scores above the largest lost value, so when that
            # value is below the k-th kept one no lost block belongs to the top-k and the short lists'
            # answer is exact (a -inf block never enters a list anyway). Else (several of the top-k in
            # one thread's blocks {c * 128 + i}, or a tie with the k-th) the full lists run, one row a
            # step: the rare path, kept small (Mosaic's lowering time grows faster than the kernel's IR).
            select_row(lane_list, True, u)
            kth, lost = v_buf[MERGE_ROUNDS % 2, topk - 1, 0], v_buf[MERGE_ROUNDS % 2, kp, 0]
            jax.lax.cond((lost < kth) | (lost == NEG_INF), lambda: None, lambda: select_row(topk, False, 1))
        else:
            select_row(topk, False, u)
        out = empty_i
        for t in range(topk):
            out = jnp.where(lane == t, i_buf[MERGE_ROUNDS % 2, t, 0], out)  # thread 0's list
        o_smem[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, out_cols)], out_ref.at[row])
        plgpu.wait_smem_to_gmem(0)

    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=jax.ShapeDtypeStruct((r, out_cols), jnp.int32),
        grid=(r,),
        grid_names=("row",),
        scratch_types=[
            plgpu.SMEM((n_rows, LANES), jnp.float32),
            plgpu.SMEM((2, kp + 1, MERGE_COLS), jnp.float32),  # row kp: the lists' largest lost value
            plgpu.SMEM((2, kp, MERGE_COLS), jnp.int32),
            plgpu.SMEM((LANES,), jnp.int32),
            plgpu.Barrier(num_barriers=1),
        ],
        # Pallas would wrap every vector SMEM store in two warpgroup barriers (64 per merge round at
        # top-16); the kernel orders its cross-thread SMEM traffic itself with commit_smem.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
    )
    return kern(scores, q_pos, *(() if unscale is None else (unscale,)))


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "local_blocks", "init_blocks", "force_in",
                                             "force_out", "rows_per_step", "lane_list", "interpret"))
def select_blocks(scores, q_pos, *, block_size, topk, local_blocks=1, init_blocks=0, force_in=(), force_out=(),
                  rows_per_step=ROWS_PER_STEP, lane_list=LANE_LIST, interpret=None):
    """int32 [B, Hi, Q, topk] from fp32 scores [B, Hi, Q, nb] and positions q_pos [B, Q].

    Scores of blocks past a row's causal limit must be ``-inf`` (``msa.block_scores``' contract):
    the kernel does not visit them.
    """
    b, hi, q, nb = scores.shape
    if reason := unsupported_reason(nb, topk):
        raise ValueError(reason)
    n_rows = -(-nb // LANES)
    rows = b * hi * q
    # Padding blocks lie after every own block: -inf, never forced.
    s = jnp.pad(scores.astype(jnp.float32).reshape(rows, nb), [(0, 0), (0, n_rows * LANES - nb)],
                constant_values=NEG_INF)
    ids = _kernel_call(s.reshape(rows, n_rows, LANES), q_pos.astype(jnp.int32), hi, block_size=block_size, topk=topk,
                       local_blocks=local_blocks, init_blocks=init_blocks, force_in=force_in, force_out=force_out,
                       rows_per_step=rows_per_step, lane_list=lane_list, interpret=interpret)
    return ids[:, :topk].reshape(b, hi, q, topk)


@functools.partial(jax.jit, static_argnames=("heads", "num_blocks", "block_size", "topk", "local_blocks",
                                             "init_blocks", "force_in", "force_out", "rows_per_step", "lane_list",
                                             "interpret"))
def select_blocks_rows(score_rows, q_pos, unscale=None, *, heads, num_blocks, block_size, topk, local_blocks=1,
                       init_blocks=0, force_in=(), force_out=(), rows_per_step=ROWS_PER_STEP, lane_list=LANE_LIST,
                       interpret=None):
    """int32 [B, heads, Q, topk] from a scoring kernel's rows read in place: fp32 score_rows
    [B, n_rows, nb] (nb >= num_blocks, a multiple of 128; row ``h * Q + t`` of request b holds its
    block scores, rows past ``heads * Q`` unused), positions q_pos [B, Q] and ``unscale`` fp32
    [B, heads * Q] (each row's factor, or None). Blocks after a row's own block are -inf whatever the
    rows hold there (:func:`m3jax.pallas.decode.kernel.score_out_shape`: never written), so neither a
    transpose nor a mask of the scores runs in XLA before the kernel. The same ids as
    :func:`select_blocks` on the masked, scaled scores' first ``num_blocks`` blocks."""
    b, n_rows, nb = score_rows.shape
    q = q_pos.shape[1]
    if nb % LANES or n_rows < heads * q or nb < num_blocks:
        raise ValueError(f"score_rows {score_rows.shape}: blocks must be whole rows of {LANES}, at least "
                         f"num_blocks={num_blocks}, and the rows must hold heads * Q = {heads * q}")
    if reason := unsupported_reason(num_blocks, topk):
        raise ValueError(reason)
    ids = _kernel_call(score_rows.reshape(b * n_rows, nb // LANES, LANES), q_pos.astype(jnp.int32), heads,
                       block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                       force_in=force_in, force_out=force_out, rows_per_step=rows_per_step, row_stride=n_rows,
                       unscale=unscale, num_blocks=num_blocks, lane_list=lane_list, interpret=interpret)
    return ids[:, :topk].reshape(b, heads, q, topk)
