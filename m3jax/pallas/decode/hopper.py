"""Hopper (sm_90a) MSA decode kernels: paged index-block scoring, the fused paged selection (scores,
block max and each context split's top-k in one launch) and sparse paged attention with ``wgmma``
into register accumulators, over :mod:`.kernel`'s shared plan and launch pieces (design in
:mod:`.kernel`'s docstring). Chosen by :func:`m3jax.pallas._backend.arch_module`; Blackwell's are in
:mod:`.blackwell`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import mosaic_kernel, pl, plgpu
from m3jax.pallas._common import online_softmax_step, p_mma_parts, softmax_normalisers, swizzle_transforms
from m3jax.pallas.decode.kernel import (
    FP8,
    SELECT_LANES,
    DecodeScoreConfig,
    SparseDecodeConfig,
    attention_call,
    attention_plan,
    attention_refs,
    cta_start,
    keys_in_registers,
    kv_pipeline,
    merge_candidates,
    page_transforms,
    round_up,
    score_chunks,
    score_operands,
    score_out_shape,
    score_pipeline,
    score_products,
    score_prologue,
    score_result,
    score_scratch,
    score_shapes,
    score_stages,
    score_tile_cols,
    softmax_start,
    step_operands,
    store_split,
    store_page_scores,
    stream_pages,
    visible_keys,
)
from m3jax.pallas.topk import select


def _block_max(q_smem, k_smems, prods, q: int, bs: int, n_pad: int, seq_len, j):
    """What both scoring kernels compute per page: the page's ``[bs, n_pad]`` scores by wgmma (keys
    as M, query rows as N; ``k_smems`` the key parts in SMEM, or one register array of fp8 keys
    converted in registers), masked causally and max-reduced over the keys: the ``[n_pad]`` block-max
    row of logical block ``j``. (Call it inside the pipeline step: no vector values closed over by
    the pipeline loop.)"""
    # query position of accumulator column n (n = h * Q + t): seq_len - Q + t
    col = plgpu.broadcasted_iota(jnp.int32, (bs, n_pad), 1, layout=plgpu.Layout.WGMMA)
    row = plgpu.broadcasted_iota(jnp.int32, (bs, n_pad), 0, layout=plgpu.Layout.WGMMA)
    q_pos = seq_len - q + lax.rem(col, q)

    def mma(acc_ref):
        for a, c in prods:
            plgpu.wgmma(acc_ref, k_smems[a], q_smem.at[c].transpose((1, 0)))
        return acc_ref[...]

    s = pl.run_scoped(mma, plgpu.ACC((bs, n_pad), jnp.float32))
    return jnp.where(row + j * bs <= q_pos, s, -jnp.inf).max(axis=0)


@functools.partial(jax.jit, static_argnames=("block_size", "config", "score_dtype", "interpret"))
def decode_index_scores(
    iq: jax.Array,
    ik_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    block_size: int,
    config: DecodeScoreConfig = DecodeScoreConfig(),
    score_dtype: str = "bfloat16",
    interpret: bool | None = None,
) -> jax.Array:
    """Block-max index scores of the Q new tokens over a paged index-key cache.

    Args:
      iq: [B, Q, Hi, Hx] index queries; ik_pages: [num_pages, block_size, Hx] index keys (bf16,
      fp16, fp32 or fp8 e4m3); page_table: int32 [B, max_pages]; seq_lens: int32 [B] (including
      the Q new tokens); score_dtype: ``"float8_e4m3fn"`` is the fp8 indexer over fp8 pages (the
      query rows quantised to e4m3, one e4m3 x e4m3 wgmma per page straight from the TMA-loaded
      page, the row scales applied after the block max: :func:`.kernel.score_operands`).
    Returns:
      fp32 [B, Hi, Q, max_pages]: ``max_{t in block j, t <= pos(q)} iq[q, h] . ik[t]``, -inf for
      blocks with no visible key (future or unused pages).
    """
    rows, unscale = decode_index_score_rows(iq, ik_pages, page_table, seq_lens, block_size=block_size, config=config,
                                            score_dtype=score_dtype, interpret=interpret)
    b, q, hi, _ = iq.shape
    return score_result(rows, seq_lens, block_size, (b, hi, q), page_table.shape[1], unscale)


@functools.partial(jax.jit, static_argnames=("block_size", "config", "score_dtype", "interpret"))
def decode_index_score_rows(iq, ik_pages, page_table, seq_lens, *, block_size: int,
                            config: DecodeScoreConfig = DecodeScoreConfig(), score_dtype: str = "bfloat16",
                            interpret: bool | None = None):
    """The scoring kernel's own output, what the row-split top-k reads in place: fp32 rows
    [B, n_pad, pages] (:func:`.kernel.score_out_shape`; row ``h * Q + t``, blocks past the live pages
    unwritten) and the per-row factors fp32 [B, Hi * Q] still to be applied (or None). Args as
    :func:`decode_index_scores`."""
    b, q, hi, hx, _, bs, max_pages = score_shapes(iq, ik_pages, page_table, block_size, "wgmma M tiles")
    n_rows = hi * q
    n_pad = round_up(n_rows, 8)
    if n_pad > 256:
        raise ValueError(f"Hi*Q = {n_rows} rows exceed the wgmma N limit of 256")
    chunk, splits = score_chunks(config, b, max_pages, n_pad, ik_pages.dtype == FP8)
    q_parts, k_parts, unscale = score_operands(iq, ik_pages, config, score_dtype)
    prods = score_products(len(q_parts), len(k_parts))
    dtype = q_parts[0].dtype
    transforms = swizzle_transforms(128 // jnp.dtype(dtype).itemsize, jnp.dtype(dtype).itemsize)
    if dtype == FP8:  # e4m3 x e4m3: the query tile swizzled as the pages (a wgmma's operands share one swizzle)
        transforms = page_transforms(k_parts, hx, transforms)
    registers = keys_in_registers(config, q_parts, k_parts, interpret)
    tile = (chunk, score_tile_cols(n_pad, chunk))
    stages = score_stages(config, chunk, q_parts, k_parts, n_pad, hx, bs, tile=tile, registers=registers)

    def body(*refs):
        q_smem, k_gmem, pt_gmem, out_gmem, score_smem, mma_keys, _, bi, seq_len, first, steps = score_prologue(
            refs, len(q_parts), len(k_parts), chunk, bs, registers=registers)

        def page_step(idx, *k_smems):
            (i,) = idx
            row = _block_max(q_smem, mma_keys(k_smems), prods, q, bs, n_pad, seq_len, first + i)
            store_page_scores(score_smem, i, row)

        score_pipeline(page_step, k_gmem, pt_gmem, out_gmem, score_smem, bi, first, steps, chunk,
                        (bs, hx), page_transforms(k_parts, hx, transforms), stages)

    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=score_out_shape(b, n_pad, splits, chunk),
        scratch_types=score_scratch(q_parts, k_parts, n_pad, hx, bs, tile, transforms, registers=registers),
        grid=(b, splits),
        grid_names=("b", "s"),
    )
    return kern(*q_parts, *k_parts, page_table.astype(jnp.int32), seq_lens.astype(jnp.int32)), unscale


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "local_blocks", "init_blocks", "force_in",
                                             "force_out", "config", "interpret"))
def decode_select_blocks(
    iq: jax.Array,
    ik_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    block_size: int,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
    force_in: tuple[int, ...] = (),
    force_out: tuple[int, ...] = (),
    config: DecodeScoreConfig = DecodeScoreConfig(),
    interpret: bool | None = None,
) -> jax.Array:
    """Top-k block ids of the Q new tokens over a paged index-key cache, in one kernel launch
    (scores, block max and each context split's top-k; :mod:`.kernel`'s docstring, item 3) plus
    the merge of the splits' candidates by the top-k kernel (:func:`.kernel.merge_candidates`).

    Args: as :func:`decode_index_scores`, and the selection's ``topk``, ``local_blocks``,
      ``init_blocks``, ``force_in``, ``force_out`` (:func:`m3jax.msa.reference.select_blocks`).
    Returns:
      int32 [B, Hi, Q, topk] in the reference order: forced blocks first, then descending score with
      ties to the lower block id, ``-1`` padding.
    """
    b, q, hi, hx, _, bs, max_pages = score_shapes(iq, ik_pages, page_table, block_size, "wgmma M tiles")
    n_rows = hi * q
    n_pad = round_up(n_rows, 8)
    if n_rows > SELECT_LANES:
        raise ValueError(f"Hi*Q = {n_rows} rows exceed the fused selection's {SELECT_LANES} lanes (one row each)")
    if topk < 1:
        raise ValueError(f"decode_select_blocks: topk must be >= 1, got {topk}")
    chunk, splits = score_chunks(config, b, max_pages, None, ik_pages.dtype == FP8)
    kc = min(topk, chunk)  # a split's list: its top-k, or all its pages when it has fewer
    q_parts, k_parts, unscale = score_operands(iq, ik_pages, config)
    prods = score_products(len(q_parts), len(k_parts))
    dtype = q_parts[0].dtype
    transforms = swizzle_transforms(128 // jnp.dtype(dtype).itemsize, jnp.dtype(dtype).itemsize)
    scaled = unscale is not None
    registers = keys_in_registers(config, q_parts, k_parts, interpret)
    # (the lists' SMEM for the output is taken after the pipeline, from the page buffers' space)
    stages = score_stages(config, chunk, q_parts, k_parts, n_pad, hx, bs, tile=(2, SELECT_LANES),
                          extra=SELECT_LANES * 4 if scaled else 0, registers=registers)
    lanes = plgpu.Layout.WG_STRIDED((SELECT_LANES,), 1)  # lane n = query row n = h * Q + t
    cols = plgpu.Layout.WGMMA.reduce(0)  # the block-max row's layout: whole in every warp
    forcing = dict(local_blocks=local_blocks, init_blocks=init_blocks, force_in=tuple(force_in))
    rank = functools.partial(select.ranked_candidate, force_out=tuple(force_out), **forcing)

    def body(*refs):
        q_smem, k_gmem, pt_gmem, io, rows_smem, mma_keys, own, bi, seq_len, first, steps = score_prologue(
            refs, len(q_parts), len(k_parts), chunk, bs, n_io=int(scaled) + 2, registers=registers)
        vals_gmem, ids_gmem = io[-2:]
        if scaled:
            unscale_smem, unscale_bar = own
            plgpu.copy_gmem_to_smem(io[0].at[bi], unscale_smem, unscale_bar)
            plgpu.barrier_wait(unscale_bar)

        def page_step(idx, *k_smems_and_carry):
            (i,) = idx
            *k_smems, (lists, kth, own_block) = k_smems_and_carry
            j = first + i
            row = _block_max(q_smem, mma_keys(k_smems), prods, q, bs, n_pad, seq_len, j)
            if scaled:  # undo the query's power-of-two scaling before ranking, as score_result does
                row = row * plgpu.load(unscale_smem.at[pl.ds(0, n_pad)], layout=cols)
            # Threshold: the lists change only where a row's value beats its k-th kept value ``kth``
            # (strictly: pages come in increasing block id, so an equal value never displaces), or
            # where a forced priority can raise the value above the score. Otherwise the insertion
            # is a no-op and is skipped. The test runs in the row's own layout, whose values every
            # warp holds whole (the block max reduced across the warps), so the vote is a shuffle
            # reduction inside each warp and the same in all four: a warpgroup-uniform branch that
            # needs no SMEM and no barrier. Lanes n >= Hi * Q are padding (no query row).
            n = plgpu.broadcasted_iota(jnp.int32, (n_pad,), 0, layout=cols)
            beats = jnp.max(jnp.where((row > kth) & (n < n_rows), 1, 0)) > 0
            forced = select.may_force(j, seq_len - q, seq_len - 1, block_size=bs, **forcing)

            def insert():
                # The row goes through SMEM from its layout to one lane per query row (the lists'),
                # the new k-th values back. No commit_smem: nothing asynchronous reads these rows,
                # and the kernel keeps Pallas' automatic barriers, a warpgroup barrier before and
                # after each SMEM store, which order every thread's earlier loads of a row before
                # the store and the store before every later load.
                slot, kth_slot = rows_smem.at[0], rows_smem.at[1]
                if n_pad == SELECT_LANES:
                    slot[...] = row
                else:
                    slot[pl.ds(0, n_pad)] = row  # lanes past n_pad belong to no query row
                x = plgpu.load(slot, layout=lanes)
                # Pages arrive in increasing block id and the insertion is strict: ties to the lower id.
                vals, ids = select.insert(*lists, rank(x, own_block - j, j), j)

                def refresh():
                    kth_slot[...] = vals[-1]
                    return plgpu.load(kth_slot.at[pl.ds(0, n_pad)], layout=cols)

                # The split's first k - 1 pages cannot fill a list: its k-th values stay -inf.
                return (vals, ids), lax.cond(i >= kc - 1, refresh, lambda: kth), own_block

            return lax.cond(beats | forced, insert, lambda: (lists, kth, own_block))

        empty = (tuple(jnp.full((SELECT_LANES,), -jnp.inf, jnp.float32) for _ in range(kc)),
                 tuple(jnp.full((SELECT_LANES,), -1, jnp.int32) for _ in range(kc)))
        lane = plgpu.broadcasted_iota(jnp.int32, (SELECT_LANES,), 0, layout=lanes)
        # each lane's (query row's) own block, computed once and carried (no vector closures in the loop)
        own_block = jnp.floor_divide(seq_len - q + lax.rem(lane, q), bs)
        init = (jax.tree.map(lambda x: plgpu.layout_cast(x, lanes), empty),
                plgpu.layout_cast(jnp.full((n_pad,), -jnp.inf, jnp.float32), cols), own_block)
        (vals, ids), _, _ = stream_pages(page_step, k_gmem, pt_gmem, bi, first, steps, (bs, hx),
                                         page_transforms(k_parts, hx, transforms), stages, init_carry=init)

        def store(vals_smem, ids_smem):  # scoped after the pipeline: the page buffers' SMEM, now free
            for r in range(kc):
                vals_smem[r] = vals[r]
                ids_smem[r] = ids[r]
            plgpu.commit_smem()
            si = lax.axis_index("s")
            plgpu.copy_smem_to_gmem(vals_smem, vals_gmem.at[bi, si])
            plgpu.copy_smem_to_gmem(ids_smem, ids_gmem.at[bi, si])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((kc, SELECT_LANES), jnp.float32), plgpu.SMEM((kc, SELECT_LANES), jnp.int32))

    # the score tile: two staging rows of SELECT_LANES (a block-max row, the k-th values; the chunk's
    # rows never all live in SMEM)
    scratch = score_scratch(q_parts, k_parts, n_pad, hx, bs, (2, SELECT_LANES), transforms, registers=registers)
    if scaled:
        scratch += [plgpu.SMEM((SELECT_LANES,), jnp.float32), plgpu.Barrier(num_arrivals=1)]
    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=(jax.ShapeDtypeStruct((b, splits, kc, SELECT_LANES), jnp.float32),
                  jax.ShapeDtypeStruct((b, splits, kc, SELECT_LANES), jnp.int32)),
        scratch_types=scratch,
        grid=(b, splits),
        grid_names=("b", "s"),
    )
    extra = (jnp.pad(unscale, [(0, 0), (0, SELECT_LANES - n_rows)], constant_values=1.0),) if scaled else ()
    vals, ids = kern(*q_parts, *k_parts, page_table.astype(jnp.int32), seq_lens.astype(jnp.int32), *extra)
    return merge_candidates(vals, ids, (b, hi, q), topk)


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret", "return_lse"))
def sparse_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    block_idx: jax.Array,
    seq_lens: jax.Array,
    *,
    block_size: int,
    config: SparseDecodeConfig = SparseDecodeConfig(),
    interpret: bool | None = None,
    return_lse: bool = False,
):
    """Sparse paged decode attention (see :mod:`.kernel`'s docstring).

    Args:
      q: [B, Q, N, H]; k_pages, v_pages: [num_pages, block_size, K, H]; page_table: int32
      [B, max_pages]; block_idx: int32 [B, K, Q, topk] logical block ids (-1 empty, unique per row);
      seq_lens: int32 [B].
    Returns:
      [B, Q, N, H] in q.dtype (and the natural-log LSE fp32 [B, Q, N] if ``return_lse``).
    """
    plan = attention_plan(q, k_pages, v_pages, page_table, block_idx, block_size, config, m_tile=64)
    m_pad, h, kv_tile, n_parts = plan.m_pad, plan.h, plan.kv_tile, plan.n_parts

    def body(*refs):
        q_gmem, k_gmem, v_gmem, log_gmem, pt_gmem, bits_gmem, len_gmem, o_gmem, lse_gmem, scratch = (
            attention_refs(plan, refs))
        q_smem, p_smem, q_bar = scratch
        bi, hk, si, seq_len, first = cta_start(plan, q_gmem, q_smem, q_bar, len_gmem)
        m0, l0 = softmax_start(plan, plgpu.Layout.WGMMA.reduce(1))
        acc0 = plgpu.layout_cast(jnp.full((m_pad, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def page_step(idx, *kv_and_carry):
            (i,) = idx
            k_smems, v_smems, (acc, m_i, l_i) = step_operands(plan, kv_and_carry)

            def qk(acc_ref):
                for a, c in plan.prods:
                    plgpu.wgmma(acc_ref, q_smem.at[a], k_smems[c].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((m_pad, kv_tile), jnp.float32)) * plan.scale
            ok = visible_keys(plan, plgpu.Layout.WGMMA, i, first, seq_len, log_gmem, bits_gmem, bi, hk)
            m_new, alpha, p, l_i = online_softmax_step(jnp.where(ok, s, -jnp.inf), m_i, l_i)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            # P goes through SMEM (wgmma A operand; the interpreter has no register-A wgmma).
            for a, part in enumerate(p_mma_parts(p, plan.n_parts, plan.dtype)):
                p_smem[a] = part
            plgpu.commit_smem()

            def pv(acc_ref):
                for a, c in plan.prods:
                    plgpu.wgmma(acc_ref, p_smem.at[a], v_smems[c])
                return acc_ref[...]

            # Fresh accumulator + add. (``pl.run_state(pv)(plgpu.ACC.init(acc))`` would accumulate in
            # place, but in jax 0.11.2 it fails to lower when the body closes over a dynamically
            # sliced SMEM ref -- the pipeline slot index becomes a scalar run_state operand -- and
            # the interpreter has no run_state over accumulators either.)
            acc = acc + pl.run_scoped(pv, plgpu.ACC((m_pad, h), jnp.float32))
            return acc, m_new, l_i

        acc, m_i, l_i = kv_pipeline(plan, page_step, k_gmem, v_gmem, log_gmem, pt_gmem, bi, hk, first, (acc0, m0, l0))
        inv, lse = softmax_normalisers(m_i, l_i)
        out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])

        def fill_o(o_smem):
            o_smem[...] = out

        store_split(plan, fill_o, lse, o_gmem, lse_gmem, bi, hk, si)

    scratch = [
        plgpu.SMEM((n_parts, m_pad, h), plan.dtype, transforms=plan.transforms),
        plgpu.SMEM((n_parts, m_pad, kv_tile), plan.dtype, transforms=plan.transforms),
        plgpu.Barrier(num_arrivals=n_parts),
    ]
    return attention_call(plan, body, scratch, seq_lens, interpret, return_lse, q.dtype)
