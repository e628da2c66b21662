"""Blackwell (sm_100a) decode index scoring: :func:`.kernel.decode_index_scores_kernel` with ``tcgen05``
MMAs into a TMEM accumulator instead of Hopper ``wgmma`` into registers.

Same signature, grid, pipeline and result (docs/KERNELS.md §2.2, "AB-swapped"): one CTA per
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
  pages are converted in SMEM as on Hopper (``kernel._convert_page``); the converted page is free
  for the next one once this page's MMAs were waited for.

Chosen by :func:`m3jax.pallas.decode.decode_index_scores` when ``current_target().mma == "tcgen05"``.
Verified here: interpret mode (which models tcgen05 and TMEM: the decode tests run under
``_backend.interpret_as(BLACKWELL)``) and lowering for sm_100a on a CPU; not run on a B200 (the
self-check canary ``decode_index_scores`` is what will say so on one). Not done: a warp-specialised
MMA warp overlapping the previous page's TMEM epilogue (double-buffered accumulator), and the
``async_load_tmem(reduce="max")`` row max where the hardware has it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import mosaic_kernel, pl, plgpu
from m3jax.pallas._common import swizzle_transforms
from m3jax.pallas.decode.kernel import (
    IndexScoreConfig,
    _page_transforms,
    _round_up,
    _score_chunks,
    _score_operands,
    _score_pipeline,
    _score_products,
    _score_prologue,
    _score_result,
    _score_scratch,
    _score_shapes,
    _score_stages,
)

TMEM_COLUMNS = 512


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret"))
def decode_index_scores_tcgen05(
    iq: jax.Array,
    ik_pages: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    block_size: int,
    config: IndexScoreConfig = IndexScoreConfig(),
    interpret: bool | None = None,
) -> jax.Array:
    """Block-max index scores of the Q new tokens over a paged index-key cache.

    Args and result as :func:`m3jax.pallas.decode.kernel.decode_index_scores_kernel`: iq
    [B, Q, Hi, Hx], ik_pages [num_pages, block_size, Hx], page_table int32 [B, max_pages], seq_lens
    int32 [B] -> fp32 [B, Hi, Q, max_pages], -inf for blocks with no visible key.
    """
    b, q, hi, hx, num_pages, bs, max_pages = _score_shapes(iq, ik_pages, page_table, block_size,
                                                           "tcgen05 M tiles of 64/128")
    n_rows = hi * q
    m_tile = 128 if bs % 128 == 0 else 64
    if m_tile == 128:
        n_pad, swizzle_elems = _round_up(n_rows, 8), 64  # tcgen05's N granularity; 128-byte swizzle
    else:
        # A 64-row MMA splits N over two lane groups and the transposed B tile may not be cut below
        # its swizzle width: N >= 2 x swizzle elements (Mosaic's layout inference), so N >= 32 with
        # a 32-byte swizzle on both operands, up to a 128-byte one for N >= 128.
        n_pad = max(32, _round_up(n_rows, 16))
        swizzle_elems = max(e for e in (16, 32, 64) if e <= n_pad // 2)
    n_tiles = bs // m_tile
    cols = n_tiles * max(32, 1 << (n_pad - 1).bit_length())  # allocations are powers of two >= 32
    if cols > TMEM_COLUMNS:
        raise ValueError(f"{n_tiles} row tiles x {n_pad} query rows need {cols} > {TMEM_COLUMNS} TMEM columns")
    chunk, splits = _score_chunks(config, b, max_pages, n_pad)
    q_parts, k_parts, unscale = _score_operands(iq, ik_pages, n_pad, config)
    prods = _score_products(len(q_parts), len(k_parts))
    transforms = swizzle_transforms(swizzle_elems)  # 16-bit operands: 2 bytes
    stages = _score_stages(config, chunk, q_parts, k_parts, n_pad, hx, bs)
    # the register layout of a TMEM load: tcgen05's for 128-row tiles, wgmma's for 64-row ones
    layout = plgpu.Layout.TCGEN05 if m_tile == 128 else plgpu.Layout.WGMMA

    def body(*refs):
        q_smem, k_gmem, pt_gmem, out_gmem, score_smem, mma_keys, own, bi, seq_len, first, steps = _score_prologue(
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
            plgpu.wait_load_tmem()  # the next page's MMAs overwrite the accumulator
            score_smem[i] = best

        _score_pipeline(page_step, k_gmem, pt_gmem, out_gmem, score_smem, bi, first, steps, chunk,
                        (bs, hx), _page_transforms(k_parts, hx, transforms), stages)

    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=jax.ShapeDtypeStruct((b, splits * chunk, n_pad), jnp.float32),
        scratch_types=[
            *_score_scratch(q_parts, k_parts, n_pad, hx, bs, chunk, transforms),
            plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
            *[plgpu.TMEM((m_tile, n_pad), jnp.float32) for _ in range(n_tiles)],
        ],
        grid=(b, splits),
        grid_names=("b", "s"),
    )
    out = kern(*q_parts, *k_parts, page_table.astype(jnp.int32), seq_lens.astype(jnp.int32))
    return _score_result(out, seq_lens, bs, (b, hi, q), max_pages, unscale)
