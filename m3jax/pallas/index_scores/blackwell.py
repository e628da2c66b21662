"""Blackwell (sm_100a) prefill index scoring: :mod:`.kernel`'s kernel with ``tcgen05`` MMAs into a TMEM
accumulator instead of Hopper ``wgmma`` into registers.

Same signature, tiling, pipeline, masks and outputs (block-major scores or the fused top-k ids); only
how a key block becomes its rows' maxima differs (:class:`.tile.RowMax`; Hopper's is in :mod:`.hopper`):

- The row tile is always 128 rows (tcgen05's M per CTA; :func:`tile_rows`): A = the Q tile [128, Hx] in SMEM, B = the key block [bs, Hx] transposed,
  N = bs (a multiple of 8: every block size the Hopper kernel takes, and the half blocks of its
  SMEM fallback), the fp32 accumulator [128, bs] in TMEM (bs <= 256 of its 512 columns).
- The MMAs are asynchronous: every product of the split pieces is issued (smallest first, as on
  Hopper), committed to a barrier (``tcgen05_commit_arrive``) and waited for; the accumulator is then
  read in pieces of at most 64 columns (``async_load_tmem`` in the TMEM-native layout: one row per
  thread, so the row max stays in-thread and a piece is 64 registers, where a whole 256-column
  block would not fit), each masked and max-reduced, and ``wait_load_tmem`` before the next block's
  MMAs overwrite the accumulator. Waiting at once keeps the SMEM key block live until its MMAs are
  done (the pipeline frees its slot when the step returns); the TMA loads of the next blocks still
  overlap.
- fp32 inputs are the three bf16 pieces of ``pallas._common.bf16_split`` as on Hopper (six MMAs per
  block; tcgen05 would run fp32 as TF32, too coarse for selections).
- The fp8 indexer's e4m3 Q tile and key block go into one ``kind::f8f6f4`` MMA; the kernel's epilogue
  scales each 64-column piece by its rows' and keys' scales before the mask.

Chosen by :func:`m3jax.pallas._backend.arch_module` when the target's MMA is ``"tcgen05"``. Verified: interpret
mode (tests/pallas/test_index_scores.py runs its cases also under ``_backend.interpret_as(BLACKWELL)``)
and lowering for sm_100a on a CPU (tests/pallas/test_lowering.py); not run on a B200 (the
``index_scores`` / ``index_scores_fp8`` / ``index_topk_fused`` self-check canaries are what will say so on
one). Not done: a warp-specialised MMA warp running a block ahead into a second TMEM accumulator while
the warpgroup reduces the previous one, 2-CTA tiles of 256 rows, ``async_load_tmem(reduce="max")``.
"""

from __future__ import annotations

import jax.numpy as jnp

from m3jax.pallas._backend import pl, plgpu
from m3jax.pallas._common import split_products, tmem_handoff
from m3jax.pallas.index_scores.tile import RowMax

ROWS = 128  # tcgen05's M per CTA (64-row MMAs use half of TMEM's lanes)
PIECE = 64  # accumulator columns read from TMEM at a time (one row per thread: 64 registers)
LAYOUT = plgpu.Layout.TCGEN05_TMEM_NATIVE


def tile_rows(rows: int, block_size: int, fused: bool) -> int:
    """Tiles of :data:`ROWS` rows, whatever ``rows`` says: the accumulator is in TMEM and read in column
    pieces, so no register limit on the block."""
    return ROWS


def row_max(n_parts: int, rows: int, bs: int) -> RowMax:
    """tcgen05 into a TMEM accumulator [rows, bs], read back in :data:`PIECE`-column pieces."""
    if rows != ROWS:
        raise ValueError(f"the tcgen05 index-score kernel takes {ROWS}-row tiles, not {rows}")

    def block_max(q_smems, k_smems, scratch_refs, epilogue):
        bar, acc = scratch_refs
        for n, (i, jp) in enumerate(reversed(split_products(n_parts))):  # smallest products first
            plgpu.tcgen05_mma(acc, q_smems[i], k_smems[jp].transpose((1, 0)), accumulate=n > 0)
        plgpu.tcgen05_commit_arrive(bar)
        plgpu.barrier_wait(bar)
        best = None
        for col0 in range(0, bs, PIECE):
            s = plgpu.async_load_tmem(acc.at[:, pl.ds(col0, min(PIECE, bs - col0))], layout=LAYOUT)
            if epilogue is not None:
                s = epilogue(s, col0, LAYOUT)
            s = s.max(axis=1)
            best = s if best is None else jnp.maximum(best, s)
        tmem_handoff("ld")  # the next block's MMAs overwrite the accumulator
        return best

    scratch = (plgpu.Barrier(num_arrivals=1, orders_tensor_core=True), plgpu.TMEM((rows, bs), jnp.float32))
    return RowMax(LAYOUT.reduce(1), scratch, block_max)
