"""Mosaic GPU kernel: MSA index block scores (fused GEMM + per-block row max), optionally fused top-k.

Design (Hopper, ``Target.HOPPER``):

* Rows. The ``Hi`` index heads are packed with query tokens into the MMA M dimension: the wrapper
  views ``iq [B, T, Hi, Hx]`` as ``[B, T*Hi, Hx]`` (row ``r = t*Hi + h``, a free reshape) and a
  CTA owns one tile of ``rows`` (64 or 128) rows = ``rows / Hi`` query tokens, loaded once by TMA.
* Columns. N = ``block_size`` keys = exactly one index block per MMA tile, K = ``Hx``. One
  ``wgmma`` per key block (bf16 operands, fp32 accumulators in registers); the key blocks
  stream through SMEM with ``plgpu.emit_pipeline`` (TMA, ``max_concurrent_steps`` buffers).
* Epilogue. The fp32 accumulator tile is reduced with a row max in registers; token-level scores
  never leave the registers. Only the diagonal region needs the causal mask, so the key loop is
  split in two pipelines: blocks ``[0, full)`` that every row of the tile sees completely (no mask)
  and blocks ``[full, nvis)`` that need the per-row mask ``key_pos <= q_pos`` (usually 1 block).
  Blocks past the tile's causal limit ``nvis`` are never loaded (skipped, written as ``-inf``).
* Output (unfused). Row-max vectors are written into an SMEM tile ``[G, rows]`` (one SMEM row per
  key block, double buffered) and stored by TMA into a *block-major* score array
  ``[B, nb_pad, T_pad*Hi]``; the public ``[B, Hi, T, nb]`` layout is one XLA transpose of that
  (``m3jax.pallas.topk`` consumes the block-major layout directly, without the transpose).
* Output (fused top-k, docs/KERNELS.md §2.8). Instead of writing scores, each row-max vector goes through
  the register insertion top-k of ``m3jax.pallas.topk.select`` (forced own/local/sink blocks,
  descending score, ties to the lower id). Only ``[B, topk, T_pad*Hi]`` int32 ids are written.
* fp32 inputs. The MMA is bf16 only; fp32 ``iq``/``ik`` are split into three bf16 pieces
  (``pallas._common.bf16_split(x, 3)``), kept as separate SMEM tiles, and six wgmmas per key block
  accumulate the products of ``split_products(3)`` (~24 mantissa bits: fp32 accuracy, because the
  scores decide selections and a bf16x3 error of ~2^-16 flips blocks that fp32 keeps apart) at 6x the
  MMA work and 3x the SMEM per stage (fewer stages; block 256 runs as two half blocks). bf16 inputs
  run one K = Hx wgmma per block.

What remains for peak (measured numbers in benchmarks/msa_index.py): a warp-specialised version
(one TMA producer warpgroup + two consumer warpgroups ping-ponging so that one warpgroup's epilogue
overlaps the other's wgmma), a persistent grid over (batch, row tile) with cost-sorted tiles for
ragged batches, and a skip of the fused top-k insertion when no row improves.

Per architecture (:mod:`.hopper`, :mod:`.blackwell`, picked by :func:`m3jax.pallas._backend.arch_module`):
only the block's row max (:class:`.tile.RowMax`) and the row tile change; Blackwell's is ``tcgen05_mma``
into a TMEM accumulator on 128-row tiles;
the pipeline, masks and outputs stay. Not done there: M = 256 rows on a 2-CTA cluster, several TMEM
accumulator stages so an MMA warp runs ahead of the epilogue, a TMA gather for paged index-K caches.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from m3jax.pallas._backend import arch_module, current_target, mosaic_kernel, pl, plgpu
from m3jax.pallas._common import bf16_split, check_dims, swizzle_transforms
from m3jax.pallas.index_scores import blackwell, hopper
from m3jax.pallas.topk import select
from m3jax.pallas.topk.kernel import select_blocks_blockmajor

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class IndexScoreConfig:
    """Tile configuration. ``rows``: MMA M rows per CTA (tokens x Hi, 64 or 128); ``group``: key
    blocks per output TMA store; ``max_concurrent_steps``: key blocks in flight; ``fused_topk``: see
    ``index_select_blocks``."""

    # 64 rows x 2 key buffers: two CTAs fit per SM, so one CTA's row-max epilogue overlaps the other's
    # MMA; faster than 128 rows x 3 buffers (benchmarks/RESULTS.md#index-score-tiles).
    rows: int = 64
    group: int = 16
    max_concurrent_steps: int = 2
    # index_select_blocks: True = top-k fused into the score kernel; False (default, the faster one:
    # benchmarks/RESULTS.md#index-score-tiles) = score kernel (block-major scores) + the topk kernel.
    fused_topk: bool = False

    def for_block(self, block_size: int, fused: bool) -> "IndexScoreConfig":
        rows = arch_module(hopper, blackwell).tile_rows(self.rows, block_size, fused)
        return dataclasses.replace(self, rows=rows)


def _kernel_call(q_parts, k_parts, rowpos, tile_info, *, s_len, block_size, nb, config, fused, topk, local_blocks,
                 init_blocks, force_in=(), force_out=(), interpret=None):
    """q_parts: 1 or 3 bf16 pieces [B, Rp, Hx] (:func:`_prepare`); k_parts likewise [B, Sp, Hx]; rowpos
    [B, Rp] i32; tile_info [B, ntiles, 2] i32 (min, max position of the tile's valid rows)."""
    n_parts = len(q_parts)
    b, r_pad, hx = q_parts[0].shape
    kx = hx * n_parts
    rows, group = config.rows, config.group
    bs = block_size
    n_tiles = r_pad // rows
    nb_pad = -(-nb // group) * group
    transforms = swizzle_transforms(hx)
    steps = _pipeline_steps(rows, kx, bs, fused, topk, config)
    full_key_blocks = s_len // bs  # blocks wholly inside [0, S)
    mma = arch_module(hopper, blackwell).row_max(n_parts, rows, bs)

    if fused:
        out_type = jax.ShapeDtypeStruct((b, topk, r_pad), jnp.int32)
    else:
        out_type = jax.ShapeDtypeStruct((b, nb_pad, r_pad), jnp.float32)

    def body(*refs):
        q_refs, k_refs = refs[:n_parts], refs[n_parts : 2 * n_parts]
        rowpos_ref, info_ref, out_ref = refs[2 * n_parts : 2 * n_parts + 3]
        q_smems = refs[2 * n_parts + 3 : 3 * n_parts + 3]
        rp_smem, o_smem, ninf_smem, bar = refs[3 * n_parts + 3 : 3 * n_parts + 7]
        mma_refs = refs[3 * n_parts + 7 :]
        bi = jax.lax.axis_index("b")
        ti = jax.lax.axis_index("tile")
        r0 = ti * rows
        minpos = info_ref[bi, ti, 0]
        maxpos = info_ref[bi, ti, 1]
        nvis = jnp.clip(jnp.floor_divide(maxpos, bs) + 1, 0, nb)
        full = jnp.clip(jnp.floor_divide(minpos + 1, bs), 0, jnp.minimum(nvis, full_key_blocks))

        for p in range(n_parts):
            plgpu.copy_gmem_to_smem(q_refs[p].at[bi, pl.ds(r0, rows)], q_smems[p], bar.at[p])
        plgpu.copy_gmem_to_smem(rowpos_ref.at[bi, pl.ds(r0, rows)], rp_smem, bar.at[n_parts])
        for p in range(n_parts + 1):
            plgpu.barrier_wait(bar.at[p])
        rowpos = plgpu.load(rp_smem, layout=mma.row_layout)

        def row_max(k_smems, j, masked):
            def mask(acc, col0, layout):  # causal and past-S mask of the tile's columns [col0, col0 + width)
                shape = acc.shape
                col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout) + (j * bs + col0)
                rp = jax.lax.broadcast_in_dim(rowpos, shape, [0])
                return jnp.where((col <= rp) & (col < s_len), acc, NEG_INF)

            return mma.row_max(q_smems, k_smems, mma_refs, mask if masked else None)

        def spec(offset):
            return plgpu.BlockSpec((bs, hx), lambda j: (j + offset, 0), transforms=transforms)

        if fused:
            init = (
                tuple(jnp.full((rows,), NEG_INF, jnp.float32) for _ in range(topk)),
                tuple(jnp.full((rows,), -1, jnp.int32) for _ in range(topk)),
            )
            init = jax.tree.map(lambda x: plgpu.layout_cast(x, mma.row_layout), init)

            def step(offset, masked):
                def fn(idx, *args):
                    k_smems, carry = args[:-1], args[-1]
                    j = idx[0] + offset
                    x = select.forced_candidate(row_max(k_smems, j, masked), rowpos, j, block_size=bs,
                                                 local_blocks=local_blocks, init_blocks=init_blocks,
                                                 force_in=force_in, force_out=force_out)
                    return select.insert(*carry, x, j)

                return fn

            carry = plgpu.emit_pipeline(step(0, False), grid=(full,), in_specs=[spec(0)] * n_parts,
                                        max_concurrent_steps=steps,
                                        init_carry=init)(*[k.at[bi] for k in k_refs])
            carry = plgpu.emit_pipeline(step(full, True), grid=(nvis - full,), in_specs=[spec(full)] * n_parts,
                                        max_concurrent_steps=steps,
                                        init_carry=carry)(*[k.at[bi] for k in k_refs])
            _, ids = carry
            for i in range(topk):
                o_smem[i] = ids[i]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[bi, :, pl.ds(r0, rows)])
            plgpu.wait_smem_to_gmem(0)
            return

        ninf_smem[...] = jnp.full((group, rows), NEG_INF, jnp.float32)

        def step(offset, masked):
            def fn(idx, *k_smems):
                j = idx[0] + offset
                g, row = jax.lax.div(j, group), jax.lax.rem(j, group)
                slot = jax.lax.rem(g, 2)

                @pl.when(row == 0)
                def _():
                    # The TMA store that last read this slot (group g - 2) must be done.
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    o_smem[slot] = jnp.full((group, rows), NEG_INF, jnp.float32)

                o_smem[slot, row] = row_max(k_smems, j, masked)

                @pl.when((row == group - 1) | (j == nvis - 1))
                def _():
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[slot], out_ref.at[bi, pl.ds(g * group, group), pl.ds(r0, rows)])

            return fn

        plgpu.emit_pipeline(step(0, False), grid=(full,), in_specs=[spec(0)] * n_parts,
                            max_concurrent_steps=steps)(*[k.at[bi] for k in k_refs])
        plgpu.emit_pipeline(step(full, True), grid=(nvis - full,), in_specs=[spec(full)] * n_parts,
                            max_concurrent_steps=steps)(*[k.at[bi] for k in k_refs])
        plgpu.commit_smem()

        @pl.loop(-(-nvis // group), nb_pad // group)
        def _(g):
            plgpu.copy_smem_to_gmem(ninf_smem, out_ref.at[bi, pl.ds(g * group, group), pl.ds(r0, rows)])

        plgpu.wait_smem_to_gmem(0)

    o_scratch = plgpu.SMEM((topk, rows), jnp.int32) if fused else plgpu.SMEM((2, group, rows), jnp.float32)
    ninf_scratch = plgpu.SMEM((8, rows), jnp.float32) if fused else plgpu.SMEM((group, rows), jnp.float32)
    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=out_type,
        grid=(b, n_tiles),
        grid_names=("b", "tile"),
        scratch_types=[
            *[plgpu.SMEM((rows, hx), jnp.bfloat16, transforms=transforms) for _ in range(n_parts)],
            plgpu.SMEM((rows,), jnp.int32),
            o_scratch,
            ninf_scratch,
            plgpu.Barrier(num_barriers=n_parts + 1),
            *mma.scratch,
        ],
    )
    return kern(*q_parts, *k_parts, rowpos, tile_info)


FP32_PARTS = 3  # bf16 pieces of an fp32 operand (see the module docstring)


def _pipeline_steps(rows, kx, bs, fused, topk, config):
    """Key-block buffers that fit next to the Q tile and the output tiles (0 if not even 2 fit)."""
    fixed = rows * kx * 2 + (topk * rows * 4 + 8 * rows * 4 if fused else 3 * config.group * rows * 4) + 4096
    steps = min(config.max_concurrent_steps, (current_target().smem_bytes - fixed) // (bs * kx * 2))
    return steps if steps >= 2 else 0


def check_inputs(where: str, iq, ik, q_pos, block_size: int | None) -> None:
    """iq [B, T, Hi, Hx], ik [B, S, Hx], q_pos [B, T]; ``block_size`` (None: any) as the kernel takes it."""
    check_dims(where, iq=(iq, "B T Hi Hx"), ik=(ik, "B S Hx"), q_pos=(q_pos, "B T"))
    if block_size is not None and (block_size < 8 or block_size % 8):
        raise ValueError(f"{where}: block_size {block_size} must be a positive multiple of 8 (a block is one MMA "
                         "tile of keys, loaded in 8-row SMEM tiles)")


def _prepare(iq, ik, q_pos, block_size, rows):
    b, t, hi, hx = iq.shape
    s_len = ik.shape[1]
    if rows % hi:
        raise ValueError(f"row tile {rows} must be a multiple of the index heads {hi}")
    nb = -(-s_len // block_size)
    tq = rows // hi
    t_pad = -(-t // tq) * tq
    if iq.dtype == jnp.float32 or ik.dtype == jnp.float32:
        qs, ks = bf16_split(iq, FP32_PARTS), bf16_split(ik, FP32_PARTS)
    else:
        qs, ks = (iq.astype(jnp.bfloat16),), (ik.astype(jnp.bfloat16),)
    qs = tuple(jnp.pad(q, [(0, 0), (0, t_pad - t), (0, 0), (0, 0)]).reshape(b, t_pad * hi, hx) for q in qs)
    if nb * block_size != s_len:
        ks = tuple(jnp.pad(k, [(0, 0), (0, nb * block_size - s_len), (0, 0)]) for k in ks)
    qp = jnp.pad(q_pos.astype(jnp.int32), [(0, 0), (0, t_pad - t)], constant_values=-1)
    rowpos = jnp.repeat(qp, hi, axis=1)  # [B, Rp], row t*Hi + h
    tiles = qp.reshape(b, t_pad // tq, tq)
    valid = tiles >= 0
    tmin = jnp.min(jnp.where(valid, tiles, jnp.iinfo(jnp.int32).max), axis=-1)
    tmax = jnp.max(tiles, axis=-1)
    tile_info = jnp.stack([tmin, tmax], axis=-1).astype(jnp.int32)
    return qs, ks, rowpos, tile_info, nb, t_pad


def _kx(iq, ik):
    split = iq.dtype == jnp.float32 or ik.dtype == jnp.float32
    return iq.shape[-1] * (FP32_PARTS if split else 1)


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret"))
def index_block_scores_blockmajor(iq, ik, q_pos, *, block_size, config=None, interpret=None):
    """Kernel-native scores: fp32 [B, nb_pad, T_pad*Hi] (row t*Hi + h; padding rows/blocks -inf or junk).

    Also returns ``rowpos`` [B, T_pad*Hi] (q_pos per row, -1 for padding rows). When two key-block
    buffers do not fit in SMEM (fp32 inputs at block 256), the kernel runs at half the block size
    and adjacent half-block maxima are max-pooled (exact: the max over a block is the max of its
    halves' maxima, and ``-inf`` halves lie in the future).
    """
    check_inputs("index_block_scores", iq, ik, q_pos, block_size)
    config = (config or IndexScoreConfig()).for_block(block_size, fused=False)
    if not _pipeline_steps(config.rows, _kx(iq, ik), block_size, False, 0, config):
        if block_size % 16:
            raise ValueError(f"block_size {block_size} too large for SMEM and not halvable")
        half, rowpos = index_block_scores_blockmajor(iq, ik, q_pos, block_size=block_size // 2, config=config,
                                                     interpret=interpret)
        nb_half = half.shape[1] + half.shape[1] % 2
        half = jnp.pad(half, [(0, 0), (0, nb_half - half.shape[1]), (0, 0)], constant_values=NEG_INF)
        return jnp.max(half.reshape(half.shape[0], nb_half // 2, 2, half.shape[2]), axis=2), rowpos
    qs, ks, rowpos, info, nb, _ = _prepare(iq, ik, q_pos, block_size, config.rows)
    out = _kernel_call(qs, ks, rowpos, info, s_len=ik.shape[1], block_size=block_size, nb=nb, config=config,
                       fused=False, topk=0, local_blocks=0, init_blocks=0, interpret=interpret)
    return out, rowpos


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret"))
def index_block_scores(iq, ik, q_pos, *, block_size, config=None, interpret=None):
    """fp32 [B, Hi, T, nb]; semantics of ``m3jax.msa.block_scores``."""
    out, _ = index_block_scores_blockmajor(iq, ik, q_pos, block_size=block_size, config=config, interpret=interpret)
    b, t, hi, _ = iq.shape  # checked by the call
    nb = -(-ik.shape[1] // block_size)
    out = out[:, :nb, : t * hi].reshape(b, nb, t, hi)
    return jnp.transpose(out, (0, 3, 2, 1))


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "local_blocks", "init_blocks", "force_in",
                                             "force_out", "config", "interpret"))
def index_select_blocks(iq, ik, q_pos, *, block_size, topk, local_blocks=1, init_blocks=0, force_in=(), force_out=(),
                        config=None, interpret=None):
    """Scores + top-k: int32 [B, Hi, T, topk].

    ``config.fused_topk=True``: one kernel, the [T, nb] score matrix is never written (docs/KERNELS.md §2.8).
    Default: the score kernel writes block-major scores that the top-k kernel reads directly
    (faster: the fused insertion serialises with the wgmma and forces 64-row tiles for registers;
    benchmarks/RESULTS.md#index-score-tiles).

    Order: forced blocks first (own, own-1, ..., sinks), then descending score, ties to the lower
    id, ``-1`` padding: the same order as ``m3jax.msa.select_blocks``.
    """
    check_inputs("index_select_blocks", iq, ik, q_pos, block_size)
    b, t, hi, _ = iq.shape
    config = (config or IndexScoreConfig()).for_block(block_size, fused=True)
    if not config.fused_topk or not _pipeline_steps(config.rows, _kx(iq, ik), block_size, True, topk, config):
        # Unfused (the default, faster as measured) or the fused kernel does not fit in SMEM:
        # block-major scores (half-block fallback if needed) + the top-k kernel, no transpose.
        scores, rowpos = index_block_scores_blockmajor(iq, ik, q_pos, block_size=block_size,
                                                       config=dataclasses.replace(config, fused_topk=False),
                                                       interpret=interpret)
        ids = select_blocks_blockmajor(scores, rowpos, block_size=block_size, topk=topk, local_blocks=local_blocks,
                                       init_blocks=init_blocks, force_in=force_in, force_out=force_out,
                                       interpret=interpret)
        ids = ids[:, :, : t * hi].reshape(b, topk, t, hi)
        return jnp.transpose(ids, (0, 3, 2, 1))
    qs, ks, rowpos, info, nb, _ = _prepare(iq, ik, q_pos, block_size, config.rows)
    ids = _kernel_call(qs, ks, rowpos, info, s_len=ik.shape[1], block_size=block_size, nb=nb, config=config,
                       fused=True, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                       force_in=force_in, force_out=force_out, interpret=interpret)
    ids = ids[:, :, : t * hi].reshape(b, topk, t, hi)
    return jnp.transpose(ids, (0, 3, 2, 1))
