"""Blackwell (sm_100a) MSA decode kernels: :mod:`.kernel`'s index scoring and sparse attention with
``tcgen05`` MMAs into TMEM accumulators instead of Hopper ``wgmma`` into registers.

**Index scoring** (:func:`decode_index_scores`). Same signature, grid, pipeline and result (docs/KERNELS.md §2.2, "AB-swapped"): one CTA per
(request, context split); per page, the ``block_size`` index keys are the MMA's M side (A from the
TMA-loaded SMEM page) and the ``Hi * Q`` query rows its N side (B = the query tile, transposed, N a
multiple of 8 as tcgen05 needs, of 16 for 64-row tiles). What differs:

- tcgen05 takes M = 128 (or 64) rows per CTA: a page is cut into ``block_size / m`` row tiles
  (m = 128 when it divides the page, else 64), each with its own TMEM accumulator (separate
  allocations: Mosaic cannot infer layouts for column slices of a 64-row one), together at most
  TMEM's 512 columns.
- The MMA is asynchronous: the CTA issues every product of every row tile, commits them to a barrier
  (``tcgen05_commit_arrive``) and waits, then loads each tile from TMEM, masks it causally and
  max-reduces it over the key rows; ``wait_load_tmem`` before the next page's MMAs overwrite TMEM.
  Waiting at once keeps the SMEM page live until its MMAs are done (the pipeline frees the slot when
  the step returns), and the next pages' TMA loads still overlap this one.
- fp32 inputs are split into bf16 pieces as on Hopper (tcgen05 would run fp32 as TF32). fp8 e4m3
  pages are converted in SMEM as on Hopper by default (``kernel.convert_page``; tcgen05 has no
  register A operand, so ``fp8_convert="registers"`` converts in SMEM here too); the converted page
  is free for the next one once this page's MMAs were waited for.

**Sparse attention** (:func:`sparse_decode_attention`): the Hopper kernel's plan (union of
selected pages, K/V pipeline, masks, online softmax, split merge: the shared ``kernel.attention_*``
helpers) with S = Q K^T in TMEM, the output accumulator kept in TMEM and rescaled there, P through
SMEM into O += P V; the ``Q * G`` rows padded to 128 (Hopper pads to 64; at most 128 rows, Q = 8
at G = 16), K/V tiles of at most 128 keys (its docstring).

Chosen by :func:`m3jax.pallas._backend.arch_module` when the target's MMA is ``"tcgen05"``. Verified here: interpret mode (which models tcgen05 and
TMEM: tests/pallas/test_decode_blackwell.py runs test_decode's checks under
``_backend.interpret_as(BLACKWELL)``) and lowering for sm_100a on a CPU; not run on a B200 (the
self-check canaries ``decode_index_scores`` / ``sparse_decode_attention`` are what will say so on
one). Not done: a warp-specialised MMA warp overlapping the previous page's TMEM epilogue
(double-buffered accumulators), the ``async_load_tmem(reduce="max")`` row max where the hardware
has it, and, in the attention, the AB-swapped form (keys as M, the few query rows as N) that would
not pad 16 rows to 128, P kept in TMEM as the A operand, and the rescale of O skipped when no row
max moved.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import mosaic_kernel, pl, plgpu
from m3jax.pallas._common import (online_softmax_step, p_mma_parts, softmax_normalisers, swizzle_transforms,
                                  tmem_handoff)
from m3jax.pallas.decode.kernel import (
    FP8,
    DecodeScoreConfig,
    SparseDecodeConfig,
    attention_call,
    attention_plan,
    attention_refs,
    cta_start,
    kv_pipeline,
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
    store_page_scores,
    store_split,
    visible_keys,
)

TMEM_COLUMNS = 512


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret"))
def decode_index_scores(
    iq: jax.Array,
    ik_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    block_size: int,
    config: DecodeScoreConfig = DecodeScoreConfig(),
    interpret: bool | None = None,
) -> jax.Array:
    """Block-max index scores of the Q new tokens over a paged index-key cache.

    Args and result as :func:`m3jax.pallas.decode.hopper.decode_index_scores`: iq
    [B, Q, Hi, Hx], ik_pages [num_pages, block_size, Hx], page_table int32 [B, max_pages], seq_lens
    int32 [B] -> fp32 [B, Hi, Q, max_pages], -inf for blocks with no visible key.
    """
    rows, unscale = decode_index_score_rows(iq, ik_pages, page_table, seq_lens, block_size=block_size, config=config,
                                            interpret=interpret)
    b, q, hi, _ = iq.shape
    return score_result(rows, seq_lens, block_size, (b, hi, q), page_table.shape[1], unscale)


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret"))
def decode_index_score_rows(iq, ik_pages, page_table, seq_lens, *, block_size: int,
                            config: DecodeScoreConfig = DecodeScoreConfig(), interpret: bool | None = None):
    """The scoring kernel's rows [B, n_pad, pages] and per-row factors (or None), as
    :func:`m3jax.pallas.decode.hopper.decode_index_score_rows`."""
    b, q, hi, hx, _, bs, max_pages = score_shapes(iq, ik_pages, page_table, block_size,
                                                           "tcgen05 M tiles of 64/128")
    n_rows = hi * q
    m_tile = 128 if bs % 128 == 0 else 64
    if m_tile == 128:
        n_pad, swizzle_elems = round_up(n_rows, 8), 64  # tcgen05's N granularity; 128-byte swizzle
    else:
        # A 64-row MMA splits N over two lane groups and the transposed B tile may not be cut below
        # its swizzle width: N >= 2 x swizzle elements (Mosaic's layout inference), so N >= 32 with
        # a 32-byte swizzle on both operands, up to a 128-byte one for N >= 128.
        n_pad = max(32, round_up(n_rows, 16))
        swizzle_elems = max(e for e in (16, 32, 64) if e <= n_pad // 2)
    n_tiles = bs // m_tile
    cols = n_tiles * max(32, 1 << (n_pad - 1).bit_length())  # allocations are powers of two >= 32
    if cols > TMEM_COLUMNS:
        raise ValueError(f"{n_tiles} row tiles x {n_pad} query rows need {cols} > {TMEM_COLUMNS} TMEM columns")
    chunk, splits = score_chunks(config, b, max_pages, n_pad, ik_pages.dtype == FP8)
    q_parts, k_parts, unscale = score_operands(iq, ik_pages, config)
    prods = score_products(len(q_parts), len(k_parts))
    transforms = swizzle_transforms(swizzle_elems)  # 16-bit operands: 2 bytes
    tile = (chunk, score_tile_cols(n_pad, chunk))
    stages = score_stages(config, chunk, q_parts, k_parts, n_pad, hx, bs, tile=tile)
    # the register layout of a TMEM load: tcgen05's for 128-row tiles, wgmma's for 64-row ones
    layout = plgpu.Layout.TCGEN05 if m_tile == 128 else plgpu.Layout.WGMMA

    def body(*refs):
        q_smem, k_gmem, pt_gmem, out_gmem, score_smem, mma_keys, own, bi, seq_len, first, steps = score_prologue(
            refs, len(q_parts), len(k_parts), chunk, bs)
        mma_bar, *acc_tmem = own

        def page_step(idx, *k_smems):
            (i,) = idx
            j = first + i
            k_smems = mma_keys(k_smems)
            for t in range(n_tiles):
                for n, (a, c) in enumerate(prods):
                    plgpu.tcgen05_mma(acc_tmem[t], k_smems[a].at[pl.ds(t * m_tile, m_tile)],
                                      q_smem.at[c].transpose((1, 0)), accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(mma_bar)
            plgpu.barrier_wait(mma_bar)
            # query position of column n (n = h * Q + t): seq_len - Q + t; key row r of tile t is token
            # j * bs + t * m_tile + r. (Built inside the loop body: no vectors closed over by the pipeline.)
            col = plgpu.broadcasted_iota(jnp.int32, (m_tile, n_pad), 1, layout=layout)
            row = plgpu.broadcasted_iota(jnp.int32, (m_tile, n_pad), 0, layout=layout)
            q_pos = seq_len - q + lax.rem(col, q)
            best = None
            for t in range(n_tiles):
                s = plgpu.async_load_tmem(acc_tmem[t], layout=layout)
                s = jnp.where(row + (j * bs + t * m_tile) <= q_pos, s, -jnp.inf).max(axis=0)
                best = s if best is None else jnp.maximum(best, s)
            tmem_handoff("ld")  # the next page's MMAs overwrite the accumulator
            store_page_scores(score_smem, i, best)

        score_pipeline(page_step, k_gmem, pt_gmem, out_gmem, score_smem, bi, first, steps, chunk,
                        (bs, hx), page_transforms(k_parts, hx, transforms), stages)

    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=score_out_shape(b, n_pad, splits, chunk),
        scratch_types=[
            *score_scratch(q_parts, k_parts, n_pad, hx, bs, tile, transforms),
            plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
            *[plgpu.TMEM((m_tile, n_pad), jnp.float32) for _ in range(n_tiles)],
        ],
        grid=(b, splits),
        grid_names=("b", "s"),
    )
    return kern(*q_parts, *k_parts, page_table.astype(jnp.int32), seq_lens.astype(jnp.int32)), unscale


ATTENTION_ROWS = 128  # tcgen05's M per CTA: the Q * G query rows of a KV head, padded
ATTENTION_MAX_KV_TILE = 128  # keys per step: S is read from TMEM whole, one row per thread
PIECE = 64  # O columns per TMEM load / store when rescaling and in the epilogue


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
    """Sparse paged decode attention on Blackwell: args, result, grid, union of selected pages, K/V
    pipeline and split merge as :func:`m3jax.pallas.decode.hopper.sparse_decode_attention`.

    The ``Q * G`` query rows of a KV head (at most 128) are the M = 128 side of both MMAs. Per K/V
    tile (at most 128 keys: S is read from TMEM whole, 128 registers per thread): S = Q K^T into a
    TMEM accumulator, committed and waited for; S read in the tcgen05 register layout (the
    TMEM-native one, a row per thread, cannot be stored to the swizzled P tile), the online softmax
    as on Hopper (:func:`m3jax.pallas._common.online_softmax_step`); the output accumulator O [128, H] lives in TMEM
    for the whole split and is rescaled by alpha in 64-column pieces (load, wait, multiply, store,
    ``commit_tmem``); P goes to SMEM (16-bit, two bf16 pieces for fp32 inputs) and O += P V is
    issued, committed and waited for before the step returns (the pipeline then reuses the V slot,
    the next step P's SMEM). The epilogue reads O in pieces, normalises it and stores it by TMA.
    """
    plan = attention_plan(q, k_pages, v_pages, page_table, block_idx, block_size, config,
                           m_tile=ATTENTION_ROWS, max_kv_tile=ATTENTION_MAX_KV_TILE)
    if plan.rows > ATTENTION_ROWS:
        raise ValueError(f"Q * G = {plan.rows} query rows exceed the {ATTENTION_ROWS}-row tcgen05 tile")
    m_pad, h, kv_tile, n_parts = plan.m_pad, plan.h, plan.kv_tile, plan.n_parts
    layout = plgpu.Layout.TCGEN05  # the TMEM-native layout (one row per thread) cannot be stored to swizzled SMEM (P)
    pieces = [(c, min(PIECE, h - c)) for c in range(0, h, PIECE)]

    def body(*refs):
        q_gmem, k_gmem, v_gmem, log_gmem, pt_gmem, bits_gmem, len_gmem, o_gmem, lse_gmem, scratch = (
            attention_refs(plan, refs))
        q_smem, p_smem, q_bar, s_bar, o_bar, s_tmem, o_tmem = scratch
        bi, hk, si, seq_len, first = cta_start(plan, q_gmem, q_smem, q_bar, len_gmem)
        for c, w in pieces:  # O starts at 0 (TMEM is not initialised; alpha = 0 would keep a NaN)
            plgpu.async_store_tmem(o_tmem.at[:, pl.ds(c, w)],
                                   plgpu.layout_cast(jnp.zeros((m_pad, w), jnp.float32), layout))
        tmem_handoff("st")  # the first P V MMA accumulates onto these zeros

        m0, l0 = softmax_start(plan, layout.reduce(1))

        def page_step(idx, *kv_and_carry):
            (i,) = idx
            k_smems, v_smems, (m_i, l_i) = step_operands(plan, kv_and_carry)
            for n, (a, c) in enumerate(plan.prods):
                plgpu.tcgen05_mma(s_tmem, q_smem.at[a], k_smems[c].transpose((1, 0)), accumulate=n > 0)
            plgpu.tcgen05_commit_arrive(s_bar)
            plgpu.barrier_wait(s_bar)
            s = plgpu.async_load_tmem(s_tmem, layout=layout) * plan.scale
            tmem_handoff("ld")  # the next step's S MMAs overwrite it
            ok = visible_keys(plan, layout, i, first, seq_len, log_gmem, bits_gmem, bi, hk)
            m_new, alpha, p, l_i = online_softmax_step(jnp.where(ok, s, -jnp.inf), m_i, l_i)
            for c, w in pieces:  # O *= alpha (the last step's P V was waited for)
                o = plgpu.async_load_tmem(o_tmem.at[:, pl.ds(c, w)], layout=layout)
                plgpu.wait_load_tmem()  # the load is asynchronous: done before the store overwrites it
                plgpu.async_store_tmem(o_tmem.at[:, pl.ds(c, w)], o * lax.broadcast_in_dim(alpha, o.shape, [0]))
            tmem_handoff("st")  # the stores are visible to the P V MMA
            for a, part in enumerate(p_mma_parts(p, plan.n_parts, plan.dtype)):
                p_smem[a] = part
            plgpu.commit_smem()
            for a, c in plan.prods:
                plgpu.tcgen05_mma(o_tmem, p_smem.at[a], v_smems[c], accumulate=True)
            plgpu.tcgen05_commit_arrive(o_bar)
            plgpu.barrier_wait(o_bar)
            return m_new, l_i

        m_i, l_i = kv_pipeline(plan, page_step, k_gmem, v_gmem, log_gmem, pt_gmem, bi, hk, first, (m0, l0))
        inv, lse = softmax_normalisers(m_i, l_i)

        def fill_o(o_smem):
            for c, w in pieces:
                o = plgpu.async_load_tmem(o_tmem.at[:, pl.ds(c, w)], layout=layout)
                o_smem[:, pl.ds(c, w)] = o * lax.broadcast_in_dim(inv, o.shape, [0])
            plgpu.wait_load_tmem()

        store_split(plan, fill_o, lse, o_gmem, lse_gmem, bi, hk, si)

    scratch = [
        plgpu.SMEM((n_parts, m_pad, h), plan.dtype, transforms=plan.transforms),
        plgpu.SMEM((n_parts, m_pad, kv_tile), plan.dtype, transforms=plan.transforms),
        plgpu.Barrier(num_arrivals=n_parts),
        plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
        plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
        plgpu.TMEM((m_pad, kv_tile), jnp.float32),
        plgpu.TMEM((m_pad, h), jnp.float32),
    ]
    return attention_call(plan, body, scratch, seq_lens, interpret, return_lse, q.dtype)
