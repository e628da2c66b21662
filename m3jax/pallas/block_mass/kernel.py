"""Mosaic GPU kernel: the indexer objective's target, the main branch's causal attention mass per key
block, averaged over each KV group's heads (:func:`m3jax.msa.reference.causal_block_mass`), without
the [T, S] softmax.

Design (docs/KERNELS.md §2.10):

* CTA = (batch, KV group, head chunk, tile of ``TQ`` = 64 query tokens, key span). A head chunk is ``hc`` of
  the group's ``gp`` query heads (all of them when their Q tiles fit in SMEM, :func:`plan`); each
  head's Q tile [64, H] is loaded once by TMA and stays in SMEM. Rows of the MMA are tokens, one
  wgmma per (head, key block), so the heads of a token share a register row and summing them is
  an element-wise add.
* Key spans. A span is a run of whole output groups of key blocks (:func:`key_spans`): one span
  when the other axes fill the GPU, more when the grid is short (a training query chunk of 256
  rows is 4 tiles per group). Each CTA covers the visible blocks of its span.
* Two passes (two launches), each a ``plgpu.emit_pipeline`` of key blocks (N = ``block_size``
  keys, one mass column per block), split as the index-score kernel's into blocks every row sees
  whole (no mask) and the diagonal ones (mask ``key <= q_pos``, ``key < S``). Pass 1: online row max
  and sum per head over the span, written as a per-span LSE; XLA merges the spans' LSEs. Pass 2:
  the scores again, ``exp2(s - lse)`` summed over the chunk's heads and over the block's keys, times
  ``1/gp``: one fp32 [64] vector per key block. Recomputing S costs a second Q K^T; keeping the
  per-block masses of pass 1 for a later rescale would need the [64, nb] tile that the output is.
* Output. The vectors go to an SMEM tile [group, 64] (double buffered) and by TMA into a block-major
  array [B, K * n_chunks, nb_pad, T_pad]; the wrapper sums the head chunks, transposes to
  [B, K, T, nb] and zeroes the blocks a row cannot see (never written by the kernel).
* fp32 inputs are split into three bf16 pieces (six products per score, fp32 accuracy, as the
  index-score kernel: the target's logits are differences of scores of size ~|q||k|/sqrt(H), where
  "bf16x3"'s 2^-16 would be ~1e-4); bf16 inputs run one product.

Hopper only (``wgmma``, :mod:`.hopper`); on other targets :func:`unsupported_reason` says so and
:func:`m3jax.msa.kernels.indexer_target_mass` takes the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from m3jax.pallas._backend import current_target, mosaic_kernel, pl, plgpu
from m3jax.pallas._common import LOG2E, bf16_split, online_softmax_step, swizzle_transforms
from m3jax.pallas.block_mass import hopper

TQ = 64  # query tokens per CTA: one wgmma M tile
GROUP = 16  # key blocks per output TMA store
FP32_PARTS = 3  # bf16 pieces of an fp32 operand (module docstring)


@dataclasses.dataclass(frozen=True)
class BlockMassConfig:
    """``max_concurrent_steps``: key blocks in flight per pipeline (fewer when SMEM is short);
    ``max_heads_per_cta``: at most this many of a group's heads per CTA (None: as many as fit);
    ``key_span_blocks``: key blocks per CTA, rounded down to whole output groups of 16 (None:
    :func:`key_spans` picks)."""

    max_concurrent_steps: int = 2
    max_heads_per_cta: int | None = None
    key_span_blocks: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    gp: int  # query heads per KV group
    hc: int  # heads per CTA (a divisor of gp)
    h: int
    bs: int
    n_parts: int
    steps: int

    @property
    def n_chunks(self) -> int:
        return self.gp // self.hc


def _n_parts(dtype) -> int:
    return 1 if jnp.dtype(dtype) == jnp.bfloat16 else FP32_PARTS


def plan(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype,
         config: BlockMassConfig = BlockMassConfig()) -> Plan | None:
    """The largest head chunk whose Q tiles fit in SMEM next to two key-block buffers and the output
    tiles (None when even one head does not)."""
    gp, n_parts = num_heads // num_kv_heads, _n_parts(dtype)
    step = n_parts * block_size * head_dim * 2
    cap = config.max_heads_per_cta or gp
    for hc in sorted((d for d in range(1, min(gp, cap) + 1) if gp % d == 0), reverse=True):
        fixed = n_parts * hc * TQ * head_dim * 2 + 2 * GROUP * TQ * 4 + TQ * 4 + 1024
        steps = min(config.max_concurrent_steps, (current_target().smem_bytes - fixed) // step)
        if steps >= 2:
            return Plan(gp=gp, hc=hc, h=head_dim, bs=block_size, n_parts=n_parts, steps=steps)
    return None


def unsupported_reason(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype,
                       config: BlockMassConfig = BlockMassConfig()) -> str | None:
    """Why the kernel cannot run these shapes on the current target (None when it can)."""
    target = current_target()
    if target.refused:
        return target.refused
    if target.mma != "wgmma":
        return f"the block-mass kernel is Hopper-only (wgmma); {target.name} has no variant yet"
    if num_heads % num_kv_heads:
        return f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
    if block_size % 8 or not 8 <= block_size <= 256:
        return f"block_size {block_size} must be a multiple of 8 up to 256 (one wgmma N tile)"
    if head_dim % 16:
        return f"head_dim {head_dim} must be a multiple of 16 (the bf16 wgmma K step)"
    if plan(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
            config=config) is None:
        return f"one head's Q tile and two key blocks of {block_size} x {head_dim} do not fit in SMEM"
    return None


def _kernel_call(q_parts, k_parts, rowpos, tile_info, lse, *, p: Plan, s_len: int, nb: int, span: int,
                 n_split: int, interpret):
    """One pass over key spans of ``span`` blocks (a multiple of GROUP), one CTA per (batch, group x
    head chunk, query tile, span).

    q_parts: [B, N, T_pad, H] bf16 pieces; k_parts: [B, K, nb*bs, H]; rowpos int32 [B, T_pad] (-1 on
    padding rows); tile_info int32 [B, n_tiles, 2] (min, max position of the tile's valid rows).
    ``lse`` None (pass 1): returns each head's LSE over its span's visible keys, fp32 [B, N, n_split,
    T_pad] (log2 units, -inf where none). ``lse`` fp32 [B, N, T_pad] (pass 2: the merged LSE, +inf
    for rows without a visible key): returns the partial masses, block-major fp32
    [B, K * n_chunks, n_split * span, T_pad], unwritten past a tile's visible blocks."""
    b, _, t_pad, h = q_parts[0].shape
    kh = k_parts[0].shape[1]
    n_parts, hc, bs, gp = p.n_parts, p.hc, p.bs, p.gp
    n_tiles = t_pad // TQ
    full_key_blocks = s_len // bs  # blocks wholly inside [0, S)
    scale = (h**-0.5) * LOG2E  # scores in log2 units
    transforms = swizzle_transforms(h)
    mass_pass = lse is not None

    def body(*refs):
        q_refs, k_refs = refs[:n_parts], refs[n_parts : 2 * n_parts]
        rest = refs[2 * n_parts :]
        rowpos_ref, info_ref = rest[:2]
        lse_ref, rest = (rest[2], rest[3:]) if mass_pass else (None, rest[2:])
        out_ref, q_smem, rp_smem, v_smem, o_smem, q_bar, rp_bar, lse_bar = rest
        bi = jax.lax.axis_index("b")
        gc = jax.lax.axis_index("gc")
        # Tiles in reverse: the last ones see the most keys, so they start first and the short ones
        # fill the tail of the grid (causal load balance).
        ti = n_tiles - 1 - jax.lax.axis_index("tile")
        sp = jax.lax.axis_index("span")
        g, c = jax.lax.div(gc, p.n_chunks), jax.lax.rem(gc, p.n_chunks)
        head0 = g * gp + c * hc
        t0 = ti * TQ
        minpos, maxpos = info_ref[bi, ti, 0], info_ref[bi, ti, 1]
        nvis = jnp.clip(jnp.floor_divide(maxpos, bs) + 1, 0, nb)
        full = jnp.clip(jnp.floor_divide(minpos + 1, bs), 0, jnp.minimum(nvis, full_key_blocks))
        lo = sp * span
        hi = jnp.clip(nvis, lo, lo + span)  # this CTA's blocks: [lo, hi)
        mid = jnp.clip(full, lo, hi)  # [lo, mid) unmasked, [mid, hi) diagonal

        for a in range(n_parts):
            for i in range(hc):
                plgpu.copy_gmem_to_smem(q_refs[a].at[bi, head0 + i, pl.ds(t0, TQ)], q_smem.at[a, i], q_bar)
        plgpu.copy_gmem_to_smem(rowpos_ref.at[bi, pl.ds(t0, TQ)], rp_smem, rp_bar)
        if mass_pass:
            for i in range(hc):
                plgpu.copy_gmem_to_smem(lse_ref.at[bi, head0 + i, pl.ds(t0, TQ)], v_smem.at[i], lse_bar)
        plgpu.barrier_wait(q_bar)
        plgpu.barrier_wait(rp_bar)
        rowpos = plgpu.load(rp_smem, layout=hopper.ROW_LAYOUT)
        heads = [[q_smem.at[a, i] for a in range(n_parts)] for i in range(hc)]

        def head_scores(i, k_smems, j, masked):
            s = hopper.scores(heads[i], k_smems, (TQ, bs)) * scale
            if not masked:
                return s
            col = plgpu.broadcasted_iota(jnp.int32, (TQ, bs), 1, layout=hopper.LAYOUT) + j * bs
            rp = jax.lax.broadcast_in_dim(rowpos, (TQ, bs), [0])
            return jnp.where((col <= rp) & (col < s_len), s, -jnp.inf)

        def spec(offset):
            return plgpu.BlockSpec((bs, h), lambda j: (j + offset, 0), transforms=transforms)

        def pipelines(step, **kw):
            # [lo, mid): every valid row sees the whole block; [mid, hi): the diagonal blocks
            carry = plgpu.emit_pipeline(step(lo, False), grid=(mid - lo,), in_specs=[spec(lo)] * n_parts,
                                        max_concurrent_steps=p.steps, **kw)(*[k.at[bi, g] for k in k_refs])
            kw = {"init_carry": carry} if kw else {}
            return plgpu.emit_pipeline(step(mid, True), grid=(hi - mid,), in_specs=[spec(mid)] * n_parts,
                                       max_concurrent_steps=p.steps, **kw)(*[k.at[bi, g] for k in k_refs])

        if not mass_pass:
            # Pass 1: each head's running row max and sum over the span (log2 units).
            def lse_step(offset, masked):
                def fn(idx, *args):
                    k_smems, (ms, ls) = args[:-1], args[-1]
                    j = idx[0] + offset
                    new_m, new_l = [], []
                    for i in range(hc):
                        m_new, _, _, l_new = online_softmax_step(head_scores(i, k_smems, j, masked), ms[i], ls[i])
                        new_m.append(m_new)
                        new_l.append(l_new)
                    return tuple(new_m), tuple(new_l)

                return fn

            vec = lambda v: plgpu.layout_cast(jnp.full((TQ,), v, jnp.float32), hopper.ROW_LAYOUT)
            init = (tuple(vec(-jnp.inf) for _ in range(hc)), tuple(vec(0.0) for _ in range(hc)))
            ms, ls = pipelines(lse_step, init_carry=init)
            for i in range(hc):
                v_smem[i] = jnp.where(ls[i] > 0.0, ms[i] + jnp.log2(jnp.where(ls[i] > 0.0, ls[i], 1.0)), -jnp.inf)
            plgpu.commit_smem()
            for i in range(hc):
                plgpu.copy_smem_to_gmem(v_smem.at[i], out_ref.at[bi, head0 + i, sp, pl.ds(t0, TQ)])
            plgpu.wait_smem_to_gmem(0)
            return

        plgpu.barrier_wait(lse_bar)
        lses = [plgpu.load(v_smem.at[i], layout=hopper.ROW_LAYOUT) for i in range(hc)]

        # Pass 2: the chunk's heads' softmax weights per key block, summed, into the output tile.
        def mass_step(offset, masked):
            def fn(idx, *k_smems):
                j = idx[0] + offset
                tot = None
                for i in range(hc):
                    s = head_scores(i, k_smems, j, masked)
                    e = jnp.exp2(s - jax.lax.broadcast_in_dim(lses[i], s.shape, [0]))
                    tot = e if tot is None else tot + e
                grp, row = jax.lax.div(j, GROUP), jax.lax.rem(j, GROUP)
                slot = jax.lax.rem(grp, 2)

                # The store of group grp - 2 read this slot. The rows of a last, partial group past hi
                # go out as whatever the slot held: the wrapper's mask drops them.
                @pl.when(row == 0)
                def _():
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                o_smem[slot, row] = tot.sum(axis=1) * (1.0 / gp)

                @pl.when((row == GROUP - 1) | (j == hi - 1))
                def _():
                    plgpu.commit_smem()
                    dst = out_ref.at[bi, gc, pl.ds(grp * GROUP, GROUP), pl.ds(t0, TQ)]
                    plgpu.copy_smem_to_gmem(o_smem.at[slot], dst)

            return fn

        pipelines(mass_step)
        plgpu.wait_smem_to_gmem(0)

    if mass_pass:
        out_type = jax.ShapeDtypeStruct((b, kh * p.n_chunks, n_split * span, t_pad), jnp.float32)
    else:
        out_type = jax.ShapeDtypeStruct((b, kh * p.gp, n_split, t_pad), jnp.float32)
    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=out_type,
        grid=(b, kh * p.n_chunks, n_tiles, n_split),
        grid_names=("b", "gc", "tile", "span"),
        scratch_types=[
            plgpu.SMEM((n_parts, hc, TQ, h), jnp.bfloat16, transforms=transforms),
            plgpu.SMEM((TQ,), jnp.int32),
            plgpu.SMEM((hc, TQ), jnp.float32),  # pass 1: the LSE out; pass 2: the merged LSE in
            plgpu.SMEM((2, GROUP, TQ), jnp.float32),
            plgpu.Barrier(num_arrivals=n_parts * hc),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=hc),  # pass 2's LSE tiles
        ],
    )
    return kern(*q_parts, *k_parts, rowpos, tile_info, *([lse] if mass_pass else []))


def key_spans(num_blocks: int, ctas: int, config: BlockMassConfig) -> tuple[int, int]:
    """(blocks per key span, spans): one span when the (query tile, group, head chunk) CTAs alone
    fill the GPU twice over; else the keys split into spans of whole output groups until they do (a
    query chunk of training's size is a few tiles)."""
    groups = -(-num_blocks // GROUP)
    if config.key_span_blocks is not None:
        per = max(1, config.key_span_blocks // GROUP)
    else:
        per = -(-groups // min(groups, -(-2 * current_target().num_sms // ctas)))
    return per * GROUP, -(-groups // per)


def _prepare(q, k, q_pos, n_parts, bs):
    b, t, _, _ = q.shape
    s_len = k.shape[1]
    t_pad = -(-t // TQ) * TQ
    nb_k = -(-s_len // bs)
    if n_parts == 1:
        qs, ks = (q.astype(jnp.bfloat16),), (k.astype(jnp.bfloat16),)
    else:
        qs, ks = bf16_split(q, n_parts), bf16_split(k, n_parts)
    # Heads before tokens, so one head's tile of tokens is a TMA box with 2-D rows.
    qs = tuple(jnp.swapaxes(jnp.pad(x, [(0, 0), (0, t_pad - t), (0, 0), (0, 0)]), 1, 2) for x in qs)
    ks = tuple(jnp.swapaxes(jnp.pad(x, [(0, 0), (0, nb_k * bs - s_len), (0, 0), (0, 0)]), 1, 2) for x in ks)
    qp = jnp.pad(q_pos.astype(jnp.int32), [(0, 0), (0, t_pad - t)], constant_values=-1)
    tiles = qp.reshape(b, t_pad // TQ, TQ)
    tmin = jnp.min(jnp.where(tiles >= 0, tiles, jnp.iinfo(jnp.int32).max), axis=-1)
    tile_info = jnp.stack([tmin, jnp.max(tiles, axis=-1)], axis=-1).astype(jnp.int32)
    return qs, ks, qp, tile_info, nb_k


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks", "config", "interpret"))
def block_mass(q, k, q_pos, *, block_size: int, num_blocks: int, config: BlockMassConfig | None = None,
               interpret: bool | None = None):
    """The kernel path of :func:`m3jax.pallas.block_mass.block_mass` (shapes checked there)."""
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    dtype = jnp.bfloat16 if q.dtype == k.dtype == jnp.bfloat16 else jnp.float32
    cfg = config or BlockMassConfig()
    p = plan(num_heads=n, num_kv_heads=kh, head_dim=h, block_size=block_size, dtype=dtype, config=cfg)
    qs, ks, rowpos, tile_info, nb_k = _prepare(q, k, q_pos, p.n_parts, block_size)
    span, n_split = key_spans(num_blocks, b * kh * p.n_chunks * (rowpos.shape[1] // TQ), cfg)
    call = functools.partial(_kernel_call, qs, ks, rowpos, tile_info, p=p, s_len=s_len, nb=nb_k, span=span,
                             n_split=n_split, interpret=interpret)
    parts = call(None)  # [B, N, n_split, T_pad]: each span's LSE, log2 units
    top = parts.max(axis=2)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    lse = jnp.where(jnp.isfinite(top), safe + jnp.log2(jnp.exp2(parts - safe[:, :, None]).sum(2)), jnp.inf)
    out = call(lse).reshape(b, kh, p.n_chunks, n_split * span, -1).sum(2)[:, :, :num_blocks, :t]
    first_key = jnp.arange(num_blocks) * block_size
    seen = (first_key[None, None, :] <= q_pos[:, :, None]) & (first_key < s_len)  # [B, T, nb]
    return jnp.where(seen[:, None], jnp.swapaxes(out, 2, 3), 0.0)
