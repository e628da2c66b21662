"""Blackwell (sm_100a) tile maths of the KV-block-major sparse attention: :mod:`.kernel`'s persistent
kernel (CSR work items, K/V block loaded once per item, Q-tile ring, staging and combine unchanged)
with its two matmuls on ``tcgen05`` into TMEM instead of Hopper ``wgmma`` into registers.

Per Q tile (:func:`tile`, chosen by :func:`m3jax.pallas._backend.arch_module` when the plan's target has
``mma == "tcgen05"``):

- Tiles of 128 rows (tcgen05's M per CTA: 8 tokens x 16 heads at M3's G), key blocks of at most 128
  (:func:`.kernel.plan_kv_major` sets both on this target).
- S = Q K^T into a TMEM accumulator [128, kb] (the products of the bf16 parts for fp32 inputs),
  committed to a barrier and waited for; then Q's slot is free (``scores_done``).
- The softmax reads S from TMEM in pieces of at most 64 columns, twice (the row max, then
  exp2 / row sum / P), so no more than a piece is live in registers; P goes to SMEM (16-bit, two
  bf16 pieces for fp32) as the A operand of O = P V.
- O = P V into a second TMEM accumulator [128, H], committed and waited for, read in 64-column
  pieces, normalised by the row sums and written to the staging tile.

S and O together take at most 128 + 256 of TMEM's 512 columns. Verified: interpret mode
(tests/pallas/test_sparse_attention.py runs KV-major cases also as built for sm_100a) and lowering
for sm_100a on a CPU; not run on a B200 (the ``sparse_attention_kv_major`` self-check canary is
what will say so on one). Not done: overlapping one tile's softmax with the next tile's S MMA (two
S accumulators and an MMA warp), P kept in TMEM as the A operand, 2-CTA tiles of 256 rows with the
K/V block multicast, a TMA gather of the Q rows. The query-major baseline has no Blackwell variant.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import pl, plgpu
from m3jax.pallas._common import LN2, LOG2E, split_products, tmem_handoff
from m3jax.pallas.sparse_attention.tile import p_operands, row_limits

ROWS = 128  # tcgen05's M per CTA
MAX_KEY_BLOCK = 128  # keys per kernel block: S [128, kb] in TMEM
PIECE = 64  # TMEM columns read at a time
LAYOUT = plgpu.Layout.TCGEN05


def _pieces(width: int) -> list[tuple[int, int]]:
    return [(c, min(PIECE, width - c)) for c in range(0, width, PIECE)]


def kv_major_tiles(m: int, stage_p: bool, kbs: tuple[int, ...]) -> tuple[int, bool, tuple[int, ...]]:
    """The KV-major plan's rows per tile, P staging and key blocks to try: 128-row tiles, P through
    SMEM, key blocks of at most :data:`MAX_KEY_BLOCK` (S [128, kb] in TMEM)."""
    return ROWS, True, tuple(kb for kb in kbs if kb <= MAX_KEY_BLOCK)


def tile(plan, dtype):
    """(attend, scratch) as :func:`.hopper.tile` for a :class:`.kernel.KVMajorPlan`, with S and O in TMEM."""
    m, gp, bs, h, n_parts = plan.m, plan.gp, plan.kb, plan.h, plan.n_parts
    scale = (h**-0.5) * LOG2E
    prods = split_products(n_parts)

    def attend(q_tiles, k_tiles, v_tiles, lims, o_smem, p_smem, mma_refs, scores_done):
        bar, s_tmem, o_tmem = mma_refs
        for n, (a, c) in enumerate(prods):
            plgpu.tcgen05_mma(s_tmem, q_tiles[a], k_tiles[c].transpose((1, 0)), accumulate=n > 0)
        plgpu.tcgen05_commit_arrive(bar)
        plgpu.barrier_wait(bar)
        scores_done()

        def scores(c, w):
            s = plgpu.async_load_tmem(s_tmem.at[:, pl.ds(c, w)], layout=LAYOUT) * scale
            if lims is not None:  # only tiles holding a query whose own block this is
                col = plgpu.broadcasted_iota(jnp.int32, (m, w), 1, layout=LAYOUT) + c
                s = jnp.where(col <= row_limits(lims, m, w, gp, LAYOUT), s, -jnp.inf)
            return s

        mx = None
        for c, w in _pieces(bs):
            piece_max = scores(c, w).max(axis=1)
            mx = piece_max if mx is None else jnp.maximum(mx, piece_max)
        l = None
        for c, w in _pieces(bs):
            p = jnp.exp2(scores(c, w) - lax.broadcast_in_dim(mx, (m, w), [0]))
            l = p.sum(axis=1) if l is None else l + p.sum(axis=1)
            parts = p_operands(p, None, n_parts, dtype)  # the 16-bit pieces, in registers
            for a, part in enumerate(parts):
                (p_smem if n_parts == 1 else p_smem.at[a]).at[:, pl.ds(c, w)][...] = part
        tmem_handoff("ld")  # the next tile's S MMAs overwrite S
        plgpu.commit_smem()  # P's stores are visible to the MMA
        for n, (a, c) in enumerate(prods):
            p_tile = p_smem if n_parts == 1 else p_smem.at[a]
            plgpu.tcgen05_mma(o_tmem, p_tile, v_tiles[c], accumulate=n > 0)
        plgpu.tcgen05_commit_arrive(bar)
        plgpu.barrier_wait(bar)
        inv = 1.0 / l
        for c, w in _pieces(h):
            o = plgpu.async_load_tmem(o_tmem.at[:, pl.ds(c, w)], layout=LAYOUT)
            o_smem.at[:, pl.ds(c, w)][...] = (o * lax.broadcast_in_dim(inv, o.shape, [0])).astype(o_smem.dtype)
        tmem_handoff("ld")  # the next tile's P V MMAs overwrite O
        return (mx + jnp.log2(l)) * LN2

    scratch = [plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
               plgpu.TMEM((m, bs), jnp.float32), plgpu.TMEM((m, h), jnp.float32)]
    return attend, scratch
