"""Backward of the KV-block-major sparse attention (docs/KERNELS.md §2.9): dQ, dK, dV in one Mosaic GPU
kernel over the forward's CSR inversion, no atomics.

Given the forward's output O and natural-log LSE, per (query, head) ``D = rowsum(dO * O) - dLSE``
(XLA; ``dLSE`` is the LSE's cotangent when the caller differentiates it, else 0). Then for each edge
(query t selected key block j) with P = exp(S - LSE) over the block's visible keys:
``dV_j += P^T dO``, ``dS = P * (dO V_j^T - D)``, ``dK_j += dS^T Q / sqrt(H)``, ``dQ_t += dS K_j / sqrt(H)``.

1. :func:`.csr.build_work` inverts the selections (in ``kb``-key item blocks) into work items of at
   most ``tiles_per_item`` tiles of one (KV head, batch, block) row (:func:`item_tiles`: half of a
   persistent CTA's share, so the long rows of a local-heavy selection are spread over CTAs).
2. A persistent kernel (grid = SMs) loads an item's K and V block once and streams its Q and dO tiles
   (``tq`` tokens x ``gp`` heads, gathered per token by TMA into a ring, with the rows' LSE and D from
   edge-space arrays). ``wgs`` consumer warpgroups own ``KEY_BLOCK`` keys each of the ``kb``-key
   block (two at M3's width: one gather per tile serves 128 keys; warpgroup 0 issues the loads). Per
   tile and warpgroup, keys on the MMA rows (S^T = K Q^T, dP^T = V dO^T: the accumulators dK, dV
   [KEY_BLOCK, H] stay in registers across the item's tiles), P^T from registers (SMEM in interpret
   mode) as the A operand of dV += P^T dO, and dS^T through SMEM as the 16-bit A operand of
   dK += dS^T Q and, transposed, of dQ_e = dS K: each warpgroup computes H / wgs of dQ's columns over
   all the block's keys, after a barrier that makes both warpgroups' dS^T tiles visible. The item
   ends by writing its fp32 dK and dV partials once, to its own slot; XLA sums a row's items in a
   fixed order (no atomics, so the sum is deterministic), and a block no query selected gets zeros.
3. dQ: each edge's partial [gp, H] (the input dtype; fp32 for fp32) is staged by padded edge, as the
   forward stages its O partials, and XLA sums a query's slots in fp32 (a gather + reduce like the forward's combine). A separate
   query-major dQ kernel would re-read every selected K/V block once per query token, the memory
   bound of the query-major forward baseline; here each block is read once per item for all three.

Padding edges and zero heads of a padded group get LSE = +inf, so P = 0 and they add nothing.
Numerics as the forward: 16-bit MMAs with fp32 accumulation; fp32 inputs as bf16 parts
(:func:`m3jax.pallas._common.split_parts` in XLA; P^T and dS^T by ``bf16_split_in_kernel``) with the
three products of :func:`m3jax.pallas._common.split_products`.

Targets: Hopper (wgmma). On a tcgen05 target, and for shapes :func:`unsupported_reason` names, the
custom VJP of :func:`m3jax.pallas.sparse_attention.sparse_attention` takes the reference gradient
(:func:`.reference.sparse_attention_vjp`) instead: correct, not fast.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas import _backend
from m3jax.pallas._backend import Target, mosaic_kernel, pl, plgpu
from m3jax.pallas._common import LOG2E, p_mma_parts, split_parts, split_products

from . import csr
from .kernel import (
    SparseAttentionConfig,
    compute_dtype,
    group_rows,
    pad_groups,
    pad_kv,
    parts_shape,
    shape_reason,
    split_blocks,
    swizzled_smem,
    unpad_groups,
)
from .tile import p_operands, parts

KEY_BLOCK = 64  # keys per consumer warpgroup: the MMA rows of its S^T and of its dK / dV accumulators
MAX_G_ROWS = 64  # padded G per token: one token's heads fit the 64-row tile


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """What :func:`kv_major_backward_kernel` runs: ``gp`` rows per token, ``tq`` tokens per ``m``-row
    tile, ``wgs`` consumer warpgroups of ``KEY_BLOCK`` keys each over a ``kb = wgs * KEY_BLOCK``-key
    block, ``n_parts`` bf16 parts per operand, a ``stages``-deep Q/dO ring, P^T staged through SMEM
    (``stage_p``) or fed from registers, ``smem`` bytes per CTA, ``ctas`` persistent CTAs,
    ``tiles_per_item`` (None: :func:`item_tiles`)."""

    g: int
    gp: int
    m: int
    tq: int
    kb: int
    h: int
    n_parts: int
    stages: int
    interpret: bool
    smem: int
    ctas: int
    wgs: int = 1
    stage_p: bool = True
    tiles_per_item: int | None = None

    @property
    def cols(self) -> int:
        """dQ columns per warpgroup (and of its dK / dV staging tile)."""
        return self.h // self.wgs


def smem_bytes(*, m, h, wgs, stages, n_parts, stage_p) -> int:
    """Q and dO rings, the item's K and V block, per warpgroup its dS^T tiles (two with two
    warpgroups: the other one reads them for dQ while the next tile's are written), P^T if staged,
    its dQ staging tile (fp32 for fp32 inputs, else 16-bit) and fp32 dK / dV staging tile (16-bit
    inputs; fp32 ones share the dQ tile), the LSE and D rings."""
    kb, cols = wgs * KEY_BLOCK, h // wgs
    ds_tiles = wgs * (2 if wgs > 1 else 1) + (wgs if stage_p else 0)
    tiles = n_parts * (2 * stages * m * h + 2 * kb * h + ds_tiles * KEY_BLOCK * m) * 2
    out = wgs * m * cols * (4 if n_parts == 2 else 2)
    kv_stage = wgs * KEY_BLOCK * cols * 4 if n_parts == 1 else 0
    return tiles + out + kv_stage + 2 * stages * m * 4 + 1024


def plan_backward(*, n: int, kh: int, h: int, block_size: int, dtype, cfg: SparseAttentionConfig | None = None,
                  target: Target | None = None) -> BackwardPlan:
    """Tiles for the backward kernel; ValueError (the :func:`unsupported_reason`) if it cannot run."""
    cfg = cfg or SparseAttentionConfig()
    target = target or _backend.current_target()
    reason = shape_reason(n, kh, h, block_size, dtype, cfg)
    if reason:
        raise ValueError(reason)
    if target.mma != "wgmma":
        raise ValueError(f"the sparse-attention backward kernel is Hopper-only (wgmma); {target.name} takes the "
                         "reference gradient")
    if block_size % KEY_BLOCK:
        raise ValueError(f"block_size {block_size} must be a multiple of {KEY_BLOCK} for the backward kernel "
                         "(keys are the wgmma M side of dK and dV)")
    if h % 64:
        raise ValueError(f"head_dim {h} must be a multiple of 64 for the backward kernel (at 16 and 32 its "
                         "layouts do not lower)")
    g = n // kh
    gp = group_rows(g)
    if gp > MAX_G_ROWS:
        raise ValueError(f"query heads per KV head G={g} > {MAX_G_ROWS} for the backward kernel")
    m = 64
    n_parts = 2 if jnp.dtype(dtype) == jnp.float32 else 1
    if cfg.backward_tiles_per_item is not None and cfg.backward_tiles_per_item < 1:
        raise ValueError(f"backward_tiles_per_item {cfg.backward_tiles_per_item} must be >= 1")
    if cfg.backward_stages is not None and cfg.backward_stages not in (1, 2, 3, 4):
        raise ValueError(f"backward_stages {cfg.backward_stages} must be 1, 2, 3 or 4")
    # Two warpgroups split a 128-key block: the block and each one's dQ columns (H / 2, whole 128-byte
    # swizzle atoms) must divide; fp32's doubled tiles do not fit in SMEM next to each other.
    two = None
    if block_size % (2 * KEY_BLOCK):
        two = f"block_size {block_size} is not a multiple of {2 * KEY_BLOCK}"
    elif h % 128:
        two = f"head_dim {h} is not a multiple of 128"
    elif n_parts == 2:
        two = "fp32 inputs (their bf16 parts do not fit in SMEM twice)"
    if cfg.backward_warpgroups is not None:
        if cfg.backward_warpgroups not in (1, 2):
            raise ValueError(f"backward_warpgroups {cfg.backward_warpgroups} must be 1 or 2")
        if cfg.backward_warpgroups == 2 and two:
            raise ValueError(f"backward_warpgroups=2 needs 128-key blocks: {two}")
    interpret = not _backend.on_gpu()
    stage_p = cfg.stage_p()
    for wgs in (cfg.backward_warpgroups,) if cfg.backward_warpgroups else ((1,) if two else (2, 1)):
        for stages in (cfg.backward_stages,) if cfg.backward_stages else (4, 3, 2, 1):
            if wgs == 2 and stages == 1 and not cfg.backward_stages:
                continue  # a 1-deep ring serialises the gathers with both warpgroups' MMAs: one is faster
            # interpret mode has no SMEM limit: its P^T staging is not counted, so it runs the GPU's plan
            smem = smem_bytes(m=m, h=h, wgs=wgs, stages=stages, n_parts=n_parts, stage_p=stage_p and not interpret)
            if smem <= target.smem_bytes - 4096:
                ctas = cfg.num_ctas or (target.num_sms if _backend.on_gpu() else 2)
                return BackwardPlan(g=g, gp=gp, m=m, tq=m // gp, kb=wgs * KEY_BLOCK, h=h, n_parts=n_parts,
                                    stages=stages, interpret=interpret, smem=smem, ctas=ctas, wgs=wgs,
                                    stage_p=stage_p, tiles_per_item=cfg.backward_tiles_per_item)
    raise ValueError(f"no backward tiles fit in {target.smem_bytes} B of SMEM (H={h}, {jnp.dtype(dtype).name}"
                     + (f", {cfg.backward_stages} stages" if cfg.backward_stages else "")
                     + (f", {cfg.backward_warpgroups} warpgroups" if cfg.backward_warpgroups else "") + ")")


def item_tiles(plan: BackwardPlan, tiles_per_head: int, kh: int) -> int:
    """Tiles per work item: ``plan.tiles_per_item`` if set, else half of one CTA's share of the tiles
    (``tiles_per_head`` bounds one KV head's), at least 4. A row of more tiles becomes several items on
    different CTAs (round-robin), so no CTA waits on one long row; each extra item costs one more K/V
    load and one [kb, H] fp32 dK / dV partial pair written and summed."""
    if plan.tiles_per_item is not None:
        return plan.tiles_per_item
    return max(4, -(-kh * tiles_per_head // (2 * plan.ctas)))


def unsupported_reason(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype="bfloat16",
                       config: SparseAttentionConfig | None = None, target: Target | None = None) -> str | None:
    """Why the backward kernel cannot run these shapes on ``target`` (None when it can); then the
    gradient is the reference's. Plain Python."""
    try:
        plan_backward(n=num_heads, kh=num_kv_heads, h=head_dim, block_size=block_size, dtype=dtype, cfg=config,
                      target=target)
    except ValueError as e:
        return str(e)
    return None


def _col_limits(lims, kb, m, g):
    """[kb, m] int32 tile (WGMMA layout) whose column c holds lims[c // g]: the per-token causal limits
    with the tile's rows on the columns (S^T)."""
    col = plgpu.broadcasted_iota(jnp.int32, (kb, m), 1, layout=plgpu.Layout.WGMMA)
    out = jnp.full((kb, m), lims[-1], jnp.int32)
    for i in range(len(lims) - 2, -1, -1):
        out = jnp.where(col < (i + 1) * g, lims[i], out)
    return out


def _mm(shape, operands):
    """Sum of wgmma products ``[(a, b), ...]`` into a fresh fp32 accumulator of ``shape``."""
    def run(acc_ref):
        for a, b in operands:
            plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _accumulate(accs, operands, in_place: bool):
    """Add the wgmma products ``operands[i]`` to the register accumulators ``accs[i]``: ``in_place`` (no
    second [kb, H] accumulator live next to dK and dV) or into fresh accumulators plus an add."""
    if not in_place:
        return tuple(acc + _mm(acc.shape, ops) for acc, ops in zip(accs, operands))

    def run(refs):
        for ref, ops in zip(refs, operands):
            for a, b in ops:
                plgpu.wgmma(ref, a, b)

    return pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc in accs))


def _store_parts(x, refs, n_parts, dtype):
    """fp32 registers -> their 16-bit MMA parts in SMEM."""
    for ref, part in zip(refs, p_mma_parts(x, n_parts, dtype)):
        ref[...] = part


def _body(plan: BackwardPlan, dtype):
    m, tq, gp, kb, h, stages, n_parts = plan.m, plan.tq, plan.gp, plan.kb, plan.h, plan.stages, plan.n_parts
    wgs, kw, cols = plan.wgs, KEY_BLOCK, plan.cols
    scale2 = (h**-0.5) * LOG2E
    prods = split_products(n_parts)
    wgl = plgpu.Layout.WGMMA

    def body(*refs):
        items_ref, nitems_ref, tok_ref, lim_ref, lse_ref, d_ref = refs[:6]
        rest = refs[6:]
        q_refs, do_refs = rest[:n_parts], rest[n_parts : 2 * n_parts]
        k_refs, v_refs = rest[2 * n_parts : 3 * n_parts], rest[3 * n_parts : 4 * n_parts]
        dq_ref, dk_ref, dv_ref = rest[4 * n_parts : 4 * n_parts + 3]
        scratch = iter(rest[4 * n_parts + 3 :])
        q_smem, do_smem, k_smem, v_smem, ds_smem, out_smem = (next(scratch) for _ in range(6))
        p_smem = next(scratch) if plan.stage_p else None
        kv_stage = next(scratch) if n_parts == 1 else out_smem  # fp32: the (fp32, m = kw rows) dQ tile
        lse_smem, d_smem, kv_bar, q_bar = (next(scratch) for _ in range(4))
        # wgs = 2: ds_bar orders each tile's dS^T stores of both warpgroups before either's dQ reads
        # them; item_bar orders both warpgroups' last reads of an item's K / V before the next item's loads
        ds_bar, item_bar = (next(scratch), next(scratch)) if wgs > 1 else (None, None)
        wg = lax.axis_index("wg") if wgs > 1 else 0
        q_rings, do_rings = parts(q_smem, n_parts), parts(do_smem, n_parts)
        k_tiles, v_tiles = parts(k_smem, n_parts), parts(v_smem, n_parts)

        def mine(ref, i):
            """Warpgroup i's slot of a per-warpgroup scratch ref (no leading axis with one warpgroup)."""
            return parts(ref, n_parts) if wgs == 1 else [r.at[i] for r in parts(ref, n_parts)]

        def span(i, size):
            """Warpgroup i's ``size``-wide slice (``i`` static, or the warpgroup's axis index)."""
            return pl.ds(i * size if isinstance(i, int) else pl.multiple_of(i * size, size), size)

        def keys(tile, u):
            """Warpgroup u's KEY_BLOCK keys of an item's [kb, H] K or V tile."""
            return tile if wgs == 1 else tile.at[span(u, kw)]

        p_mine = None if not plan.stage_p else p_smem if wgs == 1 else p_smem.at[wg]
        out_mine = out_smem if wgs == 1 else out_smem.at[wg]
        kv_mine = kv_stage if wgs == 1 else kv_stage.at[wg]
        # dK and dV accumulate in place (ACC.init) only where that lowers: not in interpret mode (no
        # rule for it), and not over SMEM views with constant indices (fp32's parts, a 1-deep ring's
        # slot), which Mosaic GPU's run_state lowering rejects.
        in_place = n_parts == 1 and stages > 1 and not _backend.interpreting()

        def producer(fn):  # the one warpgroup that issues the item's TMA loads
            if wgs == 1:
                fn()
            else:
                pl.when(wg == 0)(fn)

        @plgpu.nd_loop((nitems_ref[0],), collective_axes="sm")
        def _item(info):
            w = info.index[0]
            hh, bb, blk, t0, nt = (items_ref[w, i] for i in range(5))

            def load(tile, slot):
                e0 = (t0 + tile) * tq
                for i in range(tq):
                    tok = tok_ref[hh, e0 + i]
                    at = (bb, tok, pl.ds(hh * gp, gp))
                    for a in range(n_parts):
                        plgpu.copy_gmem_to_smem(q_refs[a].at[at], q_rings[a].at[slot, pl.ds(i * gp, gp)],
                                                q_bar.at[slot])
                        plgpu.copy_gmem_to_smem(do_refs[a].at[at], do_rings[a].at[slot, pl.ds(i * gp, gp)],
                                                q_bar.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[hh, pl.ds(e0 * gp, m)], lse_smem.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(d_ref.at[hh, pl.ds(e0 * gp, m)], d_smem.at[slot], q_bar.at[slot])

            @producer
            def _():
                plgpu.commit_smem()  # the previous item's SMEM reads precede this item's TMA writes
                kv_at = (bb, pl.ds(blk * kb, kb), hh)
                for c in range(n_parts):
                    plgpu.copy_gmem_to_smem(k_refs[c].at[kv_at], k_tiles[c], kv_bar)
                    plgpu.copy_gmem_to_smem(v_refs[c].at[kv_at], v_tiles[c], kv_bar)
                for s in range(stages):
                    @pl.when(s < nt)
                    def _():
                        load(s, s)

            plgpu.barrier_wait(kv_bar)

            def tile(j, carry):
                dk, dv = carry
                slot = lax.rem(j, stages) if stages > 1 else 0
                buf = lax.rem(j, 2) if wgs > 1 else 0
                e0 = (t0 + j) * tq
                lims = [lim_ref[hh, e0 + i] for i in range(tq)]
                plgpu.barrier_wait(q_bar.at[slot])
                q_t = [r.at[slot] for r in q_rings]
                do_t = [r.at[slot] for r in do_rings]
                k_own = [keys(t, wg) for t in k_tiles]
                s_t = _mm((kw, m), [(k_own[c], q_t[a].transpose((1, 0))) for a, c in prods]) * scale2
                key = plgpu.broadcasted_iota(jnp.int32, (kw, m), 0, layout=wgl) + wg * kw
                s_t = jnp.where(key <= _col_limits(lims, kw, m, gp), s_t, -jnp.inf)  # own block: causal
                lse = plgpu.load(lse_smem.at[slot], layout=wgl.reduce(0))
                p_t = jnp.exp2(s_t - lax.broadcast_in_dim(lse, (kw, m), [1]))
                dp_t = _mm((kw, m), [(keys(v_tiles[c], wg), do_t[a].transpose((1, 0))) for a, c in prods])
                d = plgpu.load(d_smem.at[slot], layout=wgl.reduce(0))
                ds_t = p_t * (dp_t - lax.broadcast_in_dim(d, (kw, m), [1]))
                ds_mine = mine(ds_smem, wg * 2 + buf)
                _store_parts(ds_t, ds_mine, n_parts, dtype)
                p_ops = p_operands(p_t, p_mine, n_parts, dtype)  # registers, or SMEM in interpret mode
                plgpu.commit_smem()
                dk, dv = _accumulate((dk, dv), ([(ds_mine[a], q_t[c]) for a, c in prods],
                                                [(p_ops[a], do_t[c]) for a, c in prods]), in_place)
                if wgs > 1:  # both dS^T tiles are in SMEM; both warpgroups are done with this slot's Q / dO
                    plgpu.barrier_arrive(ds_bar)
                    plgpu.barrier_wait(ds_bar)
                # dQ_e = dS K over the block's keys, this warpgroup's columns of it
                my_cols = span(wg, cols) if wgs > 1 else None
                dq = _mm((m, cols), [(mine(ds_smem, u * 2 + buf)[a].transpose((1, 0)),
                                      k_tiles[c] if wgs == 1 else keys(k_tiles[c], u).at[:, my_cols])
                                     for u in range(wgs) for a, c in prods])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last dQ store left the staging tile
                out_mine[...] = (dq * (h**-0.5)).astype(out_mine.dtype)
                plgpu.commit_smem()
                dq_at = (hh, pl.ds(e0 * gp, m)) + ((my_cols,) if wgs > 1 else ())
                plgpu.copy_smem_to_gmem(out_mine, dq_ref.at[dq_at])

                @producer
                def _():
                    @pl.when(j + stages < nt)
                    def _():
                        plgpu.commit_smem()
                        load(j + stages, slot)  # every read of this slot is done (the MMAs waited)

                return dk, dv

            zero = plgpu.layout_cast(jnp.zeros((kw, h), jnp.float32), wgl)
            dk, dv = lax.fori_loop(0, nt, tile, (zero, zero))
            for grad, ref, mult in ((dk, dk_ref, h**-0.5), (dv, dv_ref, 1.0)):
                for c0 in range(0, h, cols):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    kv_mine[...] = grad[:, c0 : c0 + cols] * mult if wgs > 1 else grad * mult
                    plgpu.commit_smem()
                    at = (w,) if wgs == 1 else (w, span(wg, kw), pl.ds(c0, cols))
                    plgpu.copy_smem_to_gmem(kv_mine, ref.at[at])
            if wgs > 1:
                plgpu.barrier_arrive(item_bar)
                plgpu.barrier_wait(item_bar)

        plgpu.wait_smem_to_gmem(0)

    return body


def kv_major_backward_kernel(q_parts, do_parts, k_parts, v_parts, work: csr.KVMajorWork, lse_e, d_e, *,
                             plan: BackwardPlan, e_pad: int):
    """(dq_stage [K, E_pad*gp, H] (fp32 for fp32 inputs, else their 16-bit type), dk_items, dv_items
    [n_cap, kb, H] fp32: each work item's partial sums, in its slot; slots >= n_items are not written).
    q/do_parts [B, T, K*gp, H], k/v_parts [B, S_pad, K, H] (bf16 parts); lse_e, d_e [K, E_pad*gp] fp32
    (LSE in log2 units, +inf on padding rows)."""
    b, s_pad, kh, h = k_parts[0].shape
    dtype = q_parts[0].dtype
    m, kb, n_parts, stages, wgs, cols = plan.m, plan.kb, plan.n_parts, plan.stages, plan.wgs, plan.cols
    per_wg = (lambda n: (n,)) if wgs > 1 else (lambda n: ())  # leading axis of per-warpgroup tiles
    scratch = [
        swizzled_smem(parts_shape(n_parts, (stages, m, h)), dtype),
        swizzled_smem(parts_shape(n_parts, (stages, m, h)), dtype),
        swizzled_smem(parts_shape(n_parts, (kb, h)), dtype),
        swizzled_smem(parts_shape(n_parts, (kb, h)), dtype),
        swizzled_smem(parts_shape(n_parts, per_wg(2 * wgs) + (KEY_BLOCK, m)), dtype),  # dS^T
        (plgpu.SMEM(per_wg(wgs) + (m, cols), jnp.float32) if n_parts == 2
         else swizzled_smem(per_wg(wgs) + (m, cols), dtype)),
        *([swizzled_smem(parts_shape(n_parts, per_wg(wgs) + (KEY_BLOCK, m)), dtype)] if plan.stage_p else []),
        *([plgpu.SMEM(per_wg(wgs) + (KEY_BLOCK, cols), jnp.float32)] if n_parts == 1 else []),
        plgpu.SMEM((stages, m), jnp.float32),
        plgpu.SMEM((stages, m), jnp.float32),
        plgpu.Barrier(num_arrivals=2 * n_parts),
        plgpu.Barrier(num_arrivals=2 * plan.tq * n_parts + 2, num_barriers=stages),
        *([plgpu.Barrier(num_arrivals=wgs), plgpu.Barrier(num_arrivals=wgs)] if wgs > 1 else []),
    ]
    out_dtype = jnp.float32 if n_parts == 2 else dtype
    n_cap = work.items.shape[0]
    out_type = (
        jax.ShapeDtypeStruct((kh, e_pad * plan.gp, h), out_dtype),
        jax.ShapeDtypeStruct((n_cap, kb, h), jnp.float32),
        jax.ShapeDtypeStruct((n_cap, kb, h), jnp.float32),
    )
    call = mosaic_kernel(
        _body(plan, dtype),
        interpret=plan.interpret,
        out_type=out_type,
        scratch_types=scratch,
        grid=(plan.ctas,),
        grid_names=("sm",),
        **({"num_threads": wgs, "thread_name": "wg"} if wgs > 1 else {}),
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    return call(work.items, work.n_items, work.qtok, work.qlim, lse_e, d_e, *q_parts, *do_parts, *k_parts, *v_parts)


def _to_edges(x, epos, fill, e_pad: int):
    """Per-(query, head) rows x [B, T, K*gp] -> edge space [K, E_pad*gp] (rows of edges no slot maps to:
    ``fill``)."""
    b, kh, t, topk = epos.shape
    gp = x.shape[-1] // kh
    vals = jnp.broadcast_to(jnp.moveaxis(x.reshape(b, t, kh, gp), 2, 1)[:, :, :, None], (b, kh, t, topk, gp))
    hi = jnp.arange(kh)[None, :, None, None]
    out = jnp.full((kh, e_pad, gp), fill, jnp.float32)
    out = out.at[hi, jnp.where(epos >= 0, epos, e_pad)].set(vals, mode="drop")
    return out.reshape(kh, e_pad * gp)


def _pad_rows(x, kh, gp, fill):
    """[B, T, N] -> [B, T, K*gp] with ``fill`` in the zero heads' rows."""
    b, t, n = x.shape
    g = n // kh
    if g == gp:
        return x
    return jnp.pad(x.reshape(b, t, kh, g), [(0, 0), (0, 0), (0, 0), (0, gp - g)],
                   constant_values=fill).reshape(b, t, kh * gp)


def kv_major_backward(q, k, v, block_idx, q_pos, o, lse, do, dlse=None, *, block_size: int,
                      cfg: SparseAttentionConfig | None = None):
    """(dq, dk, dv) of :func:`.kernel.kv_major_attention` given its output ``o``, natural-log ``lse``
    [B, T, N], the cotangent ``do`` and (optionally) the LSE's ``dlse``. Shapes and dtypes as q, k, v."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    cdt = compute_dtype(q, k, v)
    plan = plan_backward(n=n, kh=kh, h=h, block_size=block_size, dtype=cdt, cfg=cfg)
    gp = plan.gp
    d = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, T, N]
    if dlse is not None:
        d = d - dlse.astype(jnp.float32)
    q_parts = split_parts(pad_groups(q.astype(cdt), kh, gp))
    do_parts = split_parts(pad_groups(do.astype(cdt), kh, gp))
    k_parts = split_parts(pad_kv(k, plan.kb).astype(cdt))
    v_parts = split_parts(pad_kv(v, plan.kb).astype(cdt))
    q_pos = q_pos.astype(jnp.int32)
    sel = split_blocks(block_idx.astype(jnp.int32), q_pos, block_size, plan.kb)
    nb = k_parts[0].shape[1] // plan.kb
    topk = sel.shape[-1]
    tpi = item_tiles(plan, -(-(b * t * topk + b * nb * (plan.tq - 1)) // plan.tq), kh)
    e_pad, _ = csr.capacities(b, t, kh, nb, topk, plan.tq, tpi)
    work = csr.build_work(sel, q_pos, num_blocks=nb, block_size=plan.kb, tq=plan.tq, tiles_per_item=tpi)
    # rows: +inf LSE on zero heads (P = 0) and padding edges; D = 0 there
    lse_e = _to_edges(_pad_rows(lse.astype(jnp.float32) * LOG2E, kh, gp, jnp.inf), work.epos, jnp.inf, e_pad)
    d_e = _to_edges(_pad_rows(d, kh, gp, 0.0), work.epos, 0.0, e_pad)
    dq_stage, dk_items, dv_items = kv_major_backward_kernel(q_parts, do_parts, k_parts, v_parts, work, lse_e, d_e,
                                                            plan=plan, e_pad=e_pad)
    # dQ: the sum of each query's edge partials (gather + reduce, as the forward's combine)
    hi = jnp.arange(kh)[None, :, None, None]
    dq = dq_stage.reshape(kh, e_pad, gp, h)[hi, jnp.maximum(work.epos, 0)]  # [B, K, T, topk, gp, H]
    dq = jnp.where((work.epos >= 0)[..., None, None], dq.astype(jnp.float32), 0.0).sum(axis=3)
    dq = unpad_groups(jnp.moveaxis(dq, 1, 2).reshape(b, t, kh * gp, h), kh, plan.g)
    # dK, dV: the sum of each row's item partials; a row of no items (a block no query selected) is 0
    s = k.shape[1]
    row_tiles = -(-t // plan.tq)  # a row holds <= T edges: one per query (selections have no duplicates)
    pieces = -(-row_tiles // tpi)  # items per row at most
    dk, dv = (_sum_items(x, work.row_items, pieces, b, nb)[:, :s] for x in (dk_items, dv_items))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _sum_items(x, row_items, pieces: int, b: int, nb: int):
    """[n_cap, kb, H] item partials -> [B, nb * kb, K, H] fp32: per (KV head, row) the sum of its
    ``row_items`` items in item order (at most ``pieces``; unwritten slots are never read)."""
    first, count = row_items[..., 0], row_items[..., 1]  # [K, B * nb]
    kh = first.shape[0]
    total = jnp.zeros(first.shape + x.shape[1:], jnp.float32)
    for p in range(pieces):
        part = x[jnp.minimum(first + p, x.shape[0] - 1)]
        total = total + jnp.where((p < count)[..., None, None], part, 0.0)
    kb, h = x.shape[1:]
    return jnp.moveaxis(total.reshape(kh, b, nb * kb, h), 0, 2)
