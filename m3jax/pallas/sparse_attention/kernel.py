"""MSA block-sparse attention for prefill in Mosaic GPU: KV-block-major kernel + LSE combine, and the
query-major baseline (docs/KERNELS.md §2.4, §2.5; semantics of :func:`m3jax.msa.sparse_attention`).

KV-block-major (``kv_major_forward``)
    1. :mod:`.csr` inverts ``block_idx`` [B, K, T, topk] into, per KV head, rows (batch, KV block) of
       the query tokens that selected the block, padded to tiles of ``tq = block_m // G`` tokens, and
       cuts each row into work items of ``<= tiles_per_item`` tiles. All on device, static shapes.
    2. A persistent kernel (``plgpu.nd_loop`` over the live work items, grid = SMs x ctas_per_sm)
       loads the item's ``block_size x H`` K and V block ONCE by TMA, then streams its Q tiles past
       it: a tile is ``tq`` query tokens x ``G`` heads of one GQA group = ``block_m`` packed rows
       (M3: 4 tokens x 16 heads = 64 rows per warpgroup MMA), gathered row-group by row-group with
       TMA into a ``q_stages``-deep ring (the item's tokens and mask limits are in SMEM, copied once
       per item), so the next tiles' Q loads overlap this tile's math. One full-tile softmax per
       (tile, block) — each (query, block) pair is met exactly once, so there is no online
       rescaling; the causal mask (own block only) comes from a per-edge limit
       ``q_pos - block * block_size``. The tile writes its normalised partial O (q.dtype), staged in
       its own consumed Q slot, and its natural-log LSE (fp32) with two contiguous TMA stores into
       staging buffers indexed by the padded edge. At 101 KiB of SMEM per CTA two CTAs share an
       SM, so one's softmax overlaps the other's MMAs and copies.
    3. The combine (docs/MSA.md §1.5) merges, per (query, head), the <= topk partials of its valid slots:
       ``O = Σ_j exp(LSE_j - M) O_j / Σ_j exp(LSE_j - M)``. It is an XLA-fused gather + reduce
       (bandwidth-bound; the measured XLA gather+reduce runs at HBM rate, docs/KERNELS.md §1.3).

Query-major (``query_major_forward``), the baseline
    One CTA per (query token, KV head): the G heads of the token are the MMA rows (padded to
    ``block_m`` rows by repeating them), the token's valid block ids are read inside the kernel
    and each block is fetched by TMA into a 2-deep ring, online softmax across blocks. Every query
    re-reads its 16 blocks (~16 FLOP/B, memory/L2-bound), which is what KV-block-major removes.

Numerics: bf16 tensor-core MMAs with fp32 accumulation and fp32 softmax (exp2 with log2 e folded into
the scale). fp32 inputs are rounded to bf16 before the MMAs (the kernels are bf16 kernels); the
output has q's dtype.

Hopper -> Blackwell (a port's work list; no code reads ``Target.mma`` yet): tcgen05 keeps S and O in TMEM
(``plgpu.TMEM`` + ``plgpu.tcgen05_mma``) instead of registers, so one CTA holds a 128-row tile
(8 tokens x 16 heads, MSA's M) and two softmax warpgroups ping-pong on two Q tiles; ``cluster=2``
pairs CTAs on a 256-row tile with the K/V block multicast to both; ``tma_gather`` replaces the
``tq`` per-token Q copies by one indexed TMA (``plgpu.Layout.TMA_INDICES``). The CSR, work list,
staging layout and combine are unchanged.

Measured (H200, M3 shapes, T=8192 queries at context 128K, bf16, random own+15 selections; history
and diagnostics in benchmarks/NOTES_msa.md): forward kernel 1.38 ms (was 2.27 ms before the item
metadata moved to SMEM and the O staging moved into the Q ring, which let two CTAs share an SM),
XLA combine 0.56 ms, CSR and glue ~0.3 ms: 2.24 ms = 238 effective TFLOP/s, 0.38x cuDNN's dense
TFLOP/s. The design is memory-bound, not MMA-bound: per (query, KV head, slot) it re-reads the
query's G x H tile and writes + re-reads a G x H bf16 partial: 7.2 GB at this shape with the K/V
blocks and the output, ~1.7 ms at HBM rate, against 0.82 ms of MMA at cuDNN's rate, so ~0.48x
cuDNN is its ceiling. The kernel alone moves 4.8 GB in 1.38 ms (3.5 TB/s).

What remains (not done here): bf16 -> fp8 partials (halves the staging traffic), a combine fused
into the kernel's epilogue through cluster/DSMEM for rows whose slots land on one cluster, warp
specialisation (FA3-style producer + two ping-ponging consumers), skipping the combine when a
query has one valid slot, and a query-major variant over the union of neighbouring queries'
blocks for real (local) selection patterns, which needs no staging at all.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.msa.reference import lse_merge
from m3jax.pallas._backend import current_target, mosaic_kernel, on_gpu, pl, plgpu
from m3jax.pallas._common import swizzle_transforms

from . import csr

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class SparseAttentionConfig:
    """Tile configuration (defaults: H200, M3 shapes).

    block_m: packed MMA rows per tile (query tokens x GQA heads); a multiple of 64 and of G.
    tiles_per_item: Q tiles per KV-major work item (the K/V block is loaded once per item).
    q_stages: depth of the KV-major kernel's Q-tile ring (>= 2; tiles in flight = q_stages - 1); each
      stage is block_m x H of SMEM (16 KiB at M3 shapes) and also stages its tile's O for the store.
    ctas_per_sm: persistent CTAs per SM for the KV-major kernel (default: as many as fit in SMEM, at
      most 2; 101 KiB per CTA at H=bs=128 with 2 stages, so 2 fit on Hopper, 1 with 3 stages).
    num_ctas: override of the persistent grid (default: SMs x ctas_per_sm on GPU, 2 in interpret mode).
    p_via_smem: stage P through SMEM for the PV MMA (default: only in interpret mode, whose wgmma
      takes SMEM operands only; on GPU P stays in registers as the wgmma A operand).
    """

    block_m: int = 64
    tiles_per_item: int = 16
    q_stages: int = 2
    ctas_per_sm: int | None = None
    num_ctas: int | None = None
    p_via_smem: bool | None = None

    def stage_p(self) -> bool:
        """Feed P to the PV wgmma from SMEM (interpret mode only supports SMEM A operands)."""
        return (not on_gpu()) if self.p_via_smem is None else self.p_via_smem

    def grid(self, smem_per_cta: int) -> int:
        """Persistent CTAs: as many per SM as fit in SMEM (at most 2: the kernel's registers allow two
        128-thread CTAs with S and O accumulators live), unless ``ctas_per_sm``/``num_ctas`` say."""
        if self.num_ctas is not None:
            return self.num_ctas
        if not on_gpu():
            return 2
        tgt = current_target()
        # smem_bytes is the per-CTA maximum (227 KiB); the SM has 1 KiB more, and reserves 1 KiB per CTA.
        fit = (tgt.smem_bytes + 1024) // (smem_per_cta + 1024)
        per_sm = self.ctas_per_sm or max(1, min(2, fit))
        return tgt.num_sms * per_sm


def _check(q, k, block_size, cfg):
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    if n % kh:
        raise ValueError(f"{n=} must be a multiple of the KV heads {kh}")
    if h % 64 or block_size % 64:
        raise ValueError(f"head_dim {h} and block_size {block_size} must be multiples of 64")
    if cfg.block_m % 64 or cfg.block_m % g or g % 8:
        raise ValueError(f"block_m {cfg.block_m} must be a multiple of 64 and of G={g}; G must be a multiple of 8")
    if block_size > 256:
        raise ValueError("block_size must be <= 256 (one wgmma N)")
    if cfg.q_stages < 2:
        raise ValueError(f"q_stages {cfg.q_stages} must be >= 2 (a tile's O is staged in its Q slot while the next loads)")


def _smem(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=swizzle_transforms(shape[-1], jnp.dtype(dtype).itemsize))


def _pad_kv(x, block_size):
    s = x.shape[1]
    pad = -s % block_size
    return x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)])


def _row_limits(lims, m, bs, g):
    """[m, bs] int32 tile whose row r holds lims[r // g] (a select ladder over the row groups)."""
    row = plgpu.broadcasted_iota(jnp.int32, (m, bs), 0, layout=plgpu.Layout.WGMMA)
    out = jnp.full((m, bs), lims[-1], jnp.int32)
    for i in range(len(lims) - 2, -1, -1):
        out = jnp.where(row < (i + 1) * g, lims[i], out)
    return out


# --------------------------------------------------------------------------------------------
# KV-block-major forward
# --------------------------------------------------------------------------------------------


def _tile_meta(qtok, qlim, tq: int, tiles_per_item: int):
    """Per-edge query tokens and mask limits [K, E_pad] -> one int32 array
    [K, n_tiles + tiles_per_item, 2, round_up(tq, 4)] (tile, {token, limit}, edge of the tile): an
    item's metadata is one TMA box, rows 16-byte wide, and the tail keeps the fixed-size copy of the
    last item in bounds."""
    kh, e_pad = qtok.shape
    x = jnp.stack([qtok.reshape(kh, e_pad // tq, tq), qlim.reshape(kh, e_pad // tq, tq)], axis=2)
    return jnp.pad(x, [(0, 0), (0, tiles_per_item), (0, 0), (0, -tq % 4)])


def kv_major_forward(q, k, v, plan: csr.KVMajorPlan, *, block_size: int, e_pad: int, cfg: SparseAttentionConfig):
    """Partial outputs per padded edge: (o_stage [K, E_pad*G, H] q.dtype, lse_stage [K, E_pad*G] f32)."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    m = cfg.block_m
    tq = m // g
    bs = block_size
    tpi = cfg.tiles_per_item
    stages = cfg.q_stages
    dtype = q.dtype
    scale = (h**-0.5) * LOG2E

    stage_p = cfg.stage_p()
    meta = _tile_meta(plan.qtok, plan.qlim, tq, tpi)

    def body(items_ref, nitems_ref, meta_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
             q_smem, k_smem, v_smem, lse_smem, meta_smem, kv_bar, meta_bar, q_bar, *p_smem):
        n_items = nitems_ref[0]

        @plgpu.nd_loop((n_items,), collective_axes="sm")
        def _item(info):
            w = info.index[0]
            hh = items_ref[w, 0]
            bb = items_ref[w, 1]
            blk = items_ref[w, 2]
            t0 = items_ref[w, 3]
            nt = items_ref[w, 4]
            # The item's per-tile query tokens and mask limits come into SMEM with one copy (read
            # from global memory one scalar at a time, they sat on every tile's critical path).
            plgpu.commit_smem()  # the previous item's SMEM reads precede this item's TMA writes
            plgpu.copy_gmem_to_smem(meta_ref.at[hh, pl.ds(t0, tpi)], meta_smem, meta_bar)
            kv_at = (bb, pl.ds(blk * bs, bs), hh)
            plgpu.copy_gmem_to_smem(k_ref.at[kv_at], k_smem, kv_bar)
            plgpu.copy_gmem_to_smem(v_ref.at[kv_at], v_smem, kv_bar)

            def load_q(tile, slot):
                for i in range(tq):
                    tok = meta_smem[tile, 0, i]
                    plgpu.copy_gmem_to_smem(
                        q_ref.at[bb, tok, pl.ds(hh * g, g)], q_smem.at[slot, pl.ds(i * g, g)], q_bar.at[slot]
                    )

            plgpu.barrier_wait(meta_bar)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's O left its ring slot
            for s in range(stages - 1):  # prologue: the ring's first stages-1 tiles in flight
                @pl.when(s < nt)
                def _():
                    load_q(s, s)

            plgpu.barrier_wait(kv_bar)

            @pl.loop(0, nt)
            def _tile(j):
                slot = lax.rem(j, stages)
                ahead = j + stages - 1
                e0 = (t0 + j) * tq
                lims = [meta_smem[j, 1, i] for i in range(tq)]
                need_mask = lims[0] < bs - 1
                for i in range(1, tq):
                    need_mask = need_mask | (lims[i] < bs - 1)
                plgpu.barrier_wait(q_bar.at[slot])

                def tile(masked: bool):
                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem.at[slot], k_smem.transpose((1, 0)))
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((m, bs), jnp.float32)) * scale
                    # This tile's Q is consumed: its slot will stage this tile's O. The tile `ahead`
                    # reuses the slot of tile j-1, whose O store must have left SMEM first.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                    @pl.when(ahead < nt)
                    def _():
                        load_q(ahead, lax.rem(ahead, stages))

                    if masked:  # only tiles holding a query whose own block this is
                        col = plgpu.broadcasted_iota(jnp.int32, (m, bs), 1, layout=plgpu.Layout.WGMMA)
                        s = jnp.where(col <= _row_limits(lims, m, bs, g), s, -jnp.inf)
                    mx = s.max(axis=1)
                    p = jnp.exp2(s - lax.broadcast_in_dim(mx, s.shape, [0]))
                    l = p.sum(axis=1)
                    p16 = p.astype(dtype)
                    if stage_p:
                        p_smem[0][...] = p16
                        plgpu.commit_smem()
                        p16 = p_smem[0]

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem)
                        return acc_ref[...]

                    acc = pl.run_scoped(pv, plgpu.ACC((m, h), jnp.float32))
                    o = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
                    lse = (mx + jnp.log2(l)) * LN2
                    q_smem.at[slot][...] = o.astype(dtype)
                    lse_smem[...] = lse
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(q_smem.at[slot], o_ref.at[hh, pl.ds(e0 * g, m)])
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[hh, pl.ds(e0 * g, m)])

                pl.when(need_mask)(lambda: tile(True))
                pl.when(jnp.logical_not(need_mask))(lambda: tile(False))

        plgpu.wait_smem_to_gmem(0)

    meta_w = meta.shape[-1]
    scratch = [
        _smem((stages, m, h), dtype),
        _smem((bs, h), dtype),
        _smem((bs, h), dtype),
        plgpu.SMEM((m,), jnp.float32),
        plgpu.SMEM((tpi, 2, meta_w), jnp.int32),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=tq, num_barriers=stages),
    ] + ([_smem((m, bs), dtype)] if stage_p else [])
    out_type = (
        jax.ShapeDtypeStruct((kh, e_pad * g, h), dtype),
        jax.ShapeDtypeStruct((kh, e_pad * g), jnp.float32),
    )
    call = mosaic_kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(cfg.grid(_kv_major_smem_bytes(m, h, bs, tpi, meta_w, stages, jnp.dtype(dtype).itemsize, stage_p)),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    return call(plan.items, plan.n_items, meta, q, k, v)


def _kv_major_smem_bytes(m, h, bs, tpi, meta_w, stages, itemsize, stage_p) -> int:
    """SMEM of one KV-major CTA as Mosaic allocates it: Q ring (which also stages O), K, V (+P), then
    the LSE staging and the metadata tile, each rounded up to 1 KiB."""
    kib = lambda n: -(-n // 1024) * 1024
    tiles = (stages * m * h + 2 * bs * h + (m * bs if stage_p else 0)) * itemsize
    return tiles + kib(4 * m) + kib(4 * tpi * 2 * meta_w) + 1024  # + barriers


def combine(o_stage, lse_stage, epos, *, n_heads: int, out_dtype, return_lse: bool = False):
    """LSE-combine of the partials (docs/MSA.md §1.5), XLA gather + reduce. Returns [B, T, N, H] (and LSE)."""
    kh, rows, h = o_stage.shape
    g = n_heads // kh
    b, _, t, topk = epos.shape
    o4 = o_stage.reshape(kh, rows // g, g, h)
    l3 = lse_stage.reshape(kh, rows // g, g)
    hi = jnp.arange(kh)[None, :, None, None]
    safe = jnp.maximum(epos, 0)
    lse = jnp.where((epos >= 0)[..., None], l3[hi, safe], -jnp.inf)  # [B, K, T, topk, G]
    part = o4[hi, safe]  # [B, K, T, topk, G, H]; rows of empty slots are masked inside the merge
    out, lse_tot = lse_merge(part, lse, axis=3)  # [B, K, T, G, H], [B, K, T, G]
    out = jnp.moveaxis(out, 1, 2).reshape(b, t, n_heads, h).astype(out_dtype)
    if not return_lse:
        return out
    return out, jnp.moveaxis(lse_tot, 1, 2).reshape(b, t, n_heads)


def kv_major_attention(q, k, v, block_idx, q_pos, *, block_size: int, cfg: SparseAttentionConfig, return_lse=False):
    out_dtype = q.dtype
    _check(q, k, block_size, cfg)
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    tq = cfg.block_m // g
    cdt = jnp.bfloat16 if q.dtype == jnp.float32 else q.dtype
    k = _pad_kv(k, block_size).astype(cdt)
    v = _pad_kv(v, block_size).astype(cdt)
    nb = k.shape[1] // block_size
    topk = block_idx.shape[-1]
    e_pad, _ = csr.capacities(b, t, kh, nb, topk, tq, cfg.tiles_per_item)
    plan = csr.build_plan(
        block_idx.astype(jnp.int32), q_pos.astype(jnp.int32), num_blocks=nb, block_size=block_size, tq=tq,
        tiles_per_item=cfg.tiles_per_item,
    )
    o_stage, lse_stage = kv_major_forward(q.astype(cdt), k, v, plan, block_size=block_size, e_pad=e_pad, cfg=cfg)
    return combine(o_stage, lse_stage, plan.epos, n_heads=n, out_dtype=out_dtype, return_lse=return_lse)


# --------------------------------------------------------------------------------------------
# Query-major baseline
# --------------------------------------------------------------------------------------------


def query_major_forward(q, k, v, blocks, n_valid, q_pos, *, block_size: int, cfg: SparseAttentionConfig):
    """blocks: int32 [B, K, T, topk] with the valid ids first; n_valid [B, K, T]. Returns (o, lse[B,K,T,G])."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    m = cfg.block_m
    bs = block_size
    dtype = q.dtype
    scale = (h**-0.5) * LOG2E

    stage_p = cfg.stage_p()
    # Two K/V stages (prefetch block j+1 while computing j) when they fit in SMEM, else one.
    stages = 2 if (4 * bs * h + 3 * m * h + m * bs) * jnp.dtype(dtype).itemsize < current_target().smem_bytes - 8192 else 1

    def body(blk_ref, nv_ref, qpos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
             q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, *p_smem):
        hh = lax.axis_index("h")
        tt = lax.axis_index("t")
        bb = lax.axis_index("b")
        nv = nv_ref[bb, hh, tt]
        qp = qpos_ref[bb, tt]

        def load_kv(j, slot):
            blk = blk_ref[bb, hh, tt, j]
            at = (bb, pl.ds(blk * bs, bs), hh)
            plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], v_bar.at[slot])

        for i in range(m // g):
            plgpu.copy_gmem_to_smem(q_ref.at[bb, tt, pl.ds(hh * g, g)], q_smem.at[pl.ds(i * g, g)], q_bar)

        @pl.when(nv > 0)
        def _():
            load_kv(0, 0)

        plgpu.barrier_wait(q_bar)

        def step(j, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(j, stages)

            if stages == 2:
                @pl.when(j + 1 < nv)
                def _():
                    load_kv(j + 1, 1 - slot)

            lim = qp - blk_ref[bb, hh, tt, j] * bs
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((m, bs), jnp.float32))
            col = plgpu.broadcasted_iota(jnp.int32, (m, bs), 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where(col <= lim, s * scale, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)
            if stage_p:
                p_smem[0][...] = p16
                plgpu.commit_smem()
                p16 = p_smem[0]
            plgpu.barrier_wait(v_bar.at[slot])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                return acc_ref[...]

            # A fresh accumulator + add (rather than ``run_state(ACC.init(acc))``) keeps one code path
            # that GPU interpret mode can run.
            acc = acc + pl.run_scoped(pv, plgpu.ACC((m, h), jnp.float32))
            if stages == 1:
                @pl.when(j + 1 < nv)
                def _():
                    load_kv(j + 1, 0)
            return acc, m_new, l_i

        m0 = plgpu.layout_cast(jnp.full((m,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l0 = plgpu.layout_cast(jnp.full((m,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        a0 = plgpu.layout_cast(jnp.full((m, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        acc, m_i, l_i = lax.fori_loop(0, nv, step, (a0, m0, l0))
        ok = l_i > 0
        inv = jnp.where(ok, 1.0 / jnp.where(ok, l_i, 1.0), 0.0)
        o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        lse_smem[...] = jnp.where(ok, (m_i + jnp.log2(jnp.where(ok, l_i, 1.0))) * LN2, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, g)], o_ref.at[bb, tt, pl.ds(hh * g, g)])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bb, hh, tt])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        _smem((m, h), dtype),
        _smem((stages, bs, h), dtype),
        _smem((stages, bs, h), dtype),
        _smem((m, h), dtype),
        plgpu.SMEM((m,), jnp.float32),
        plgpu.Barrier(num_arrivals=m // g),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    ] + ([_smem((m, bs), dtype)] if stage_p else [])
    out_type = (
        jax.ShapeDtypeStruct((b, t, n, h), dtype),
        jax.ShapeDtypeStruct((b, kh, t, m), jnp.float32),
    )
    call = mosaic_kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(kh, t, b),
        grid_names=("h", "t", "b"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    o, lse = call(blocks, n_valid, q_pos, q, k, v)
    return o, lse[..., :g]


def query_major_attention(q, k, v, block_idx, q_pos, *, block_size: int, cfg: SparseAttentionConfig, return_lse=False):
    out_dtype = q.dtype
    _check(q, k, block_size, cfg)
    n = q.shape[2]
    cdt = jnp.bfloat16 if q.dtype == jnp.float32 else q.dtype
    k = _pad_kv(k, block_size).astype(cdt)
    v = _pad_kv(v, block_size).astype(cdt)
    bi = block_idx.astype(jnp.int32)
    big = jnp.iinfo(jnp.int32).max
    blocks = jnp.sort(jnp.where(bi < 0, big, bi), axis=-1)  # valid ids first (attention is order-free)
    n_valid = (bi >= 0).sum(-1).astype(jnp.int32)
    blocks = jnp.where(blocks == big, 0, blocks)
    o, lse = query_major_forward(
        q.astype(cdt), k, v, blocks, n_valid, q_pos.astype(jnp.int32), block_size=block_size, cfg=cfg
    )
    o = o.astype(out_dtype)
    if not return_lse:
        return o
    b, kh, t, g = lse.shape
    return o, jnp.moveaxis(lse, 1, 2).reshape(b, t, n)
