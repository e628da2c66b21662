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
* fp8 indexer (``score_dtype="float8_e4m3fn"``, docs/KERNELS.md §2.1). The wrapper quantises in XLA
  with the reference's ``msa.reference.fp8_index_operands`` (e4m3 Q rows and keys, fp32 scales per row
  and per key); the kernel loads the e4m3 tiles (K-major, as Hopper's fp8 wgmma needs) and runs one
  e4m3 x e4m3 MMA per key block into fp32. The row scales come in with the Q tile, the key scales as a
  1-D block of the key pipeline, each block's padded to a multiple of 32 (:func:`_key_scale_width`:
  every pipeline slot a TMA destination at a 128-byte boundary); the epilogue multiplies by the row's,
  then the key's scale (the reference's order) before the mask and the block max.

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

from m3jax.msa.reference import FP8, fp8_index_operands
from m3jax.pallas._backend import arch_module, current_target, mosaic_kernel, pl, plgpu
from m3jax.pallas._common import bf16_split, check_dims, swizzle_transforms
from m3jax.pallas.index_scores import blackwell, hopper
from m3jax.pallas.topk import select
from m3jax.pallas.topk.kernel import select_blocks_blockmajor

NEG_INF = float("-inf")
FP8_NAME = jnp.dtype(FP8).name  # the fp8 indexer's score_dtype


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


def _kernel_call(q_parts, k_parts, scales, rowpos, tile_info, *, s_len, block_size, nb, config, fused, topk,
                 local_blocks, init_blocks, force_in=(), force_out=(), interpret=None):
    """q_parts: 1 or 3 bf16 pieces [B, Rp, Hx], or one e4m3 [B, Rp, Hx] (:func:`_prepare`); k_parts
    likewise [B, Sp, Hx]; scales: None, or with e4m3 parts the fp32 (row scales [B, Rp], key scales
    [B, nb * _key_scale_width(block_size)]); rowpos [B, Rp] i32; tile_info [B, ntiles, 2] i32 (min, max
    position of the tile's valid rows)."""
    n_parts = len(q_parts)
    n_in = 2 * n_parts + (2 if scales else 0)  # operand arrays before rowpos
    dtype = q_parts[0].dtype
    b, r_pad, hx = q_parts[0].shape
    rows, group = config.rows, config.group
    bs = block_size
    n_tiles = r_pad // rows
    nb_pad = -(-nb // group) * group
    transforms = swizzle_transforms(hx, dtype.itemsize)
    steps = _pipeline_steps(rows, _row_bytes(hx, n_parts, dtype), bs, fused, topk, config)
    full_key_blocks = s_len // bs  # blocks wholly inside [0, S)
    mma = arch_module(hopper, blackwell).row_max(n_parts, rows, bs)

    if fused:
        out_type = jax.ShapeDtypeStruct((b, topk, r_pad), jnp.int32)
    else:
        out_type = jax.ShapeDtypeStruct((b, nb_pad, r_pad), jnp.float32)

    def body(*refs):
        q_refs, k_refs = refs[:n_parts], refs[n_parts : 2 * n_parts]
        qs_ref, ks_ref = refs[2 * n_parts : n_in] if scales else (None, None)
        rowpos_ref, info_ref, out_ref = refs[n_in : n_in + 3]
        q_smems = refs[n_in + 3 : n_in + 3 + n_parts]
        rp_smem, o_smem, ninf_smem, bar = refs[n_in + 3 + n_parts : n_in + 7 + n_parts]
        qs_smem = refs[n_in + 7 + n_parts] if scales else None
        mma_refs = refs[n_in + 7 + n_parts + (1 if scales else 0) :]
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
        if scales:
            plgpu.copy_gmem_to_smem(qs_ref.at[bi, pl.ds(r0, rows)], qs_smem, bar.at[n_parts + 1])
        for p in range(n_barriers):
            plgpu.barrier_wait(bar.at[p])
        rowpos = plgpu.load(rp_smem, layout=mma.row_layout)
        q_scale = plgpu.load(qs_smem, layout=mma.row_layout) if scales else None

        def row_max(smems, j, masked):
            k_smems = smems[:n_parts]

            def epilogue(acc, col0, layout):  # on the tile's accumulator columns [col0, col0 + width)
                shape = acc.shape
                if scales:
                    # fp8: the row's scale, then the key's, on the fp32 sums (msa.reference.fp8_dot_scores' order)
                    k_scale = plgpu.load(smems[n_parts].at[pl.ds(col0, shape[1])], layout=layout.reduce(0))
                    acc = acc * jax.lax.broadcast_in_dim(q_scale, shape, [0])
                    acc = acc * jax.lax.broadcast_in_dim(k_scale, shape, [1])
                if not masked:
                    return acc
                # causal and past-S mask
                col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout) + (j * bs + col0)
                rp = jax.lax.broadcast_in_dim(rowpos, shape, [0])
                return jnp.where((col <= rp) & (col < s_len), acc, NEG_INF)

            best = mma.row_max(q_smems, k_smems, mma_refs, epilogue if masked or scales else None)
            if scales:
                # every thread's reads of the key scales done (a warpgroup barrier) before the pipeline's
                # next TMA, issued by one thread when this step returns, overwrites their slot
                plgpu.commit_smem()
            return best

        def spec(offset):
            return plgpu.BlockSpec((bs, hx), lambda j: (j + offset, 0), transforms=transforms)

        def specs(offset):  # the key block's operands (and its keys' scales)
            key_scale = [plgpu.BlockSpec((_key_scale_width(bs),), lambda j: (j + offset,))] if scales else []
            return [spec(offset)] * n_parts + key_scale

        key_refs = [k.at[bi] for k in k_refs] + ([ks_ref.at[bi]] if scales else [])

        if fused:
            init = (
                tuple(jnp.full((rows,), NEG_INF, jnp.float32) for _ in range(topk)),
                tuple(jnp.full((rows,), -1, jnp.int32) for _ in range(topk)),
            )
            init = jax.tree.map(lambda x: plgpu.layout_cast(x, mma.row_layout), init)

            def step(offset, masked):
                def fn(idx, *args):
                    smems, carry = args[:-1], args[-1]
                    j = idx[0] + offset
                    x = select.forced_candidate(row_max(smems, j, masked), rowpos, j, block_size=bs,
                                                 local_blocks=local_blocks, init_blocks=init_blocks,
                                                 force_in=force_in, force_out=force_out)
                    return select.insert(*carry, x, j)

                return fn

            carry = plgpu.emit_pipeline(step(0, False), grid=(full,), in_specs=specs(0),
                                        max_concurrent_steps=steps, init_carry=init)(*key_refs)
            carry = plgpu.emit_pipeline(step(full, True), grid=(nvis - full,), in_specs=specs(full),
                                        max_concurrent_steps=steps, init_carry=carry)(*key_refs)
            _, ids = carry
            for i in range(topk):
                o_smem[i] = ids[i]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_ref.at[bi, :, pl.ds(r0, rows)])
            plgpu.wait_smem_to_gmem(0)
            return

        ninf_smem[...] = jnp.full((group, rows), NEG_INF, jnp.float32)

        def step(offset, masked):
            def fn(idx, *smems):
                j = idx[0] + offset
                g, row = jax.lax.div(j, group), jax.lax.rem(j, group)
                slot = jax.lax.rem(g, 2)

                @pl.when(row == 0)
                def _():
                    # The TMA store that last read this slot (group g - 2) must be done.
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    o_smem[slot] = jnp.full((group, rows), NEG_INF, jnp.float32)

                o_smem[slot, row] = row_max(smems, j, masked)

                @pl.when((row == group - 1) | (j == nvis - 1))
                def _():
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[slot], out_ref.at[bi, pl.ds(g * group, group), pl.ds(r0, rows)])

            return fn

        plgpu.emit_pipeline(step(0, False), grid=(full,), in_specs=specs(0), max_concurrent_steps=steps)(*key_refs)
        plgpu.emit_pipeline(step(full, True), grid=(nvis - full,), in_specs=specs(full),
                            max_concurrent_steps=steps)(*key_refs)
        plgpu.commit_smem()

        @pl.loop(-(-nvis // group), nb_pad // group)
        def _(g):
            plgpu.copy_smem_to_gmem(ninf_smem, out_ref.at[bi, pl.ds(g * group, group), pl.ds(r0, rows)])

        plgpu.wait_smem_to_gmem(0)

    o_scratch = plgpu.SMEM((topk, rows), jnp.int32) if fused else plgpu.SMEM((2, group, rows), jnp.float32)
    ninf_scratch = plgpu.SMEM((8, rows), jnp.float32) if fused else plgpu.SMEM((group, rows), jnp.float32)
    n_barriers = n_parts + (2 if scales else 1)  # the Q pieces, rowpos (and the row scales)
    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=out_type,
        grid=(b, n_tiles),
        grid_names=("b", "tile"),
        scratch_types=[
            *[plgpu.SMEM((rows, hx), dtype, transforms=transforms) for _ in range(n_parts)],
            plgpu.SMEM((rows,), jnp.int32),
            o_scratch,
            ninf_scratch,
            plgpu.Barrier(num_barriers=n_barriers),
            *([plgpu.SMEM((rows,), jnp.float32)] if scales else []),
            *mma.scratch,
        ],
    )
    return kern(*q_parts, *k_parts, *(scales or ()), rowpos, tile_info)


FP32_PARTS = 3  # bf16 pieces of an fp32 operand (see the module docstring)
SCORE_DTYPES = ("bfloat16", FP8_NAME)  # msa.reference.block_scores' score_dtype: what the kernel multiplies


# A TMA copy's SMEM address must be a multiple of 128 bytes (CUDA's alignment table for tensor copies;
# the GPU raises CUDA_ERROR_MISALIGNED_ADDRESS otherwise). Mosaic aligns each scratch buffer, not the
# slots of a pipeline buffer, which lie at multiples of one block's bytes from its start.
TMA_SMEM_ALIGN = 128


def _key_scale_width(block_size: int) -> int:
    """fp32 key scales per key block as the kernel loads them: ``block_size`` rounded up to a multiple of
    32 (128 bytes, :data:`TMA_SMEM_ALIGN`; the pad scale 1, never read), so that every pipeline slot of
    the scales starts at a TMA-aligned address whatever the block size."""
    per = TMA_SMEM_ALIGN // 4
    return -(-block_size // per) * per


def _row_bytes(hx, n_parts, dtype) -> int:
    """SMEM bytes of one Q row or key: its operand pieces (and an fp8 row's fp32 scale)."""
    dtype = jnp.dtype(dtype)
    return hx * n_parts * dtype.itemsize + (4 if dtype == FP8 else 0)


def _operands(iq, ik, score_dtype):
    """(parts, operand dtype) the kernel multiplies: three bf16 pieces of fp32 inputs, one bf16 piece,
    or one e4m3 operand under the fp8 indexer."""
    if score_dtype == FP8_NAME:
        return 1, FP8
    return (FP32_PARTS if iq.dtype == jnp.float32 or ik.dtype == jnp.float32 else 1), jnp.bfloat16


def _pipeline_steps(rows, row_bytes, bs, fused, topk, config):
    """Key-block buffers that fit next to the Q tile and the output tiles (0 if not even 2 fit)."""
    fixed = rows * row_bytes + (topk * rows * 4 + 8 * rows * 4 if fused else 3 * config.group * rows * 4) + 4096
    # a key block's slot: its operand rows (whole multiples of 128 bytes: bs % 8, Hx bytes % 16) and an fp8
    # block's scales padded to the next 128 bytes (_key_scale_width), hence the block's bytes rounded up
    block = -(-bs * row_bytes // TMA_SMEM_ALIGN) * TMA_SMEM_ALIGN
    steps = min(config.max_concurrent_steps, (current_target().smem_bytes - fixed) // block)
    return steps if steps >= 2 else 0


def check_inputs(where: str, iq, ik, q_pos, block_size: int | None, score_dtype: str = "bfloat16") -> None:
    """iq [B, T, Hi, Hx], ik [B, S, Hx], q_pos [B, T]; ``block_size`` (None: any) as the kernel takes it;
    ``score_dtype`` one of :data:`SCORE_DTYPES`."""
    check_dims(where, iq=(iq, "B T Hi Hx"), ik=(ik, "B S Hx"), q_pos=(q_pos, "B T"))
    if score_dtype not in SCORE_DTYPES:
        raise ValueError(f"{where}: score_dtype={score_dtype!r}; choose one of {SCORE_DTYPES}")
    if block_size is not None and (block_size < 8 or block_size % 8):
        raise ValueError(f"{where}: block_size {block_size} must be a positive multiple of 8 (a block is one MMA "
                         "tile of keys, loaded in 8-row SMEM tiles)")


def fp8_unsupported_reason(index_head_dim: int) -> str | None:
    """Why the kernel cannot run the fp8 indexer (``score_dtype="float8_e4m3fn"``) at this index head
    dim (None when it can). Both MMAs take e4m3 operands from SMEM as the kernel loads them: Hopper
    ``wgmma`` (both operands K-major: the Q tile and the key block hold Hx contiguous) and Blackwell
    ``tcgen05`` (``kind::f8f6f4``)."""
    if index_head_dim % 32:
        return (f"index_head_dim {index_head_dim} must be a multiple of 32 for the fp8 indexer (e4m3 rows of at "
                "least 32 bytes: the swizzle an fp8 wgmma reads, K steps of 32)")
    return None


def _check_kernel(where, iq, ik, q_pos, block_size, score_dtype):
    check_inputs(where, iq, ik, q_pos, block_size, score_dtype)
    if score_dtype == FP8_NAME and (reason := fp8_unsupported_reason(iq.shape[-1])):
        raise ValueError(f"{where}: {reason}")


def _prepare(iq, ik, q_pos, block_size, rows, score_dtype="bfloat16", keys_fp8=False):
    b, t, hi, hx = iq.shape
    s_len = ik.shape[1]
    if rows % hi:
        raise ValueError(f"row tile {rows} must be a multiple of the index heads {hi}")
    nb = -(-s_len // block_size)
    tq = rows // hi
    t_pad = -(-t // tq) * tq
    scales = None
    if score_dtype == FP8_NAME:
        qv, q_scale, kv, k_scale = fp8_index_operands(iq, ik, keys_fp8)
        qs, ks = (qv,), (kv,)
        # padding rows and keys: scale 1 (their scores are masked or dropped; no 0 * inf)
        q_scale = jnp.pad(q_scale[..., 0], [(0, 0), (0, t_pad - t), (0, 0)], constant_values=1.0)
        k_scale = jnp.pad(k_scale[..., 0], [(0, 0), (0, nb * block_size - s_len)], constant_values=1.0)
        width = _key_scale_width(block_size)  # each block's scales padded to whole TMA-aligned slots
        k_scale = jnp.pad(k_scale.reshape(b, nb, block_size), [(0, 0), (0, 0), (0, width - block_size)],
                          constant_values=1.0).reshape(b, nb * width)
        scales = (q_scale.reshape(b, t_pad * hi), k_scale)
    elif iq.dtype == jnp.float32 or ik.dtype == jnp.float32:
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
    return qs, ks, scales, rowpos, tile_info, nb, t_pad


def _row_bytes_of(iq, ik, score_dtype):
    n_parts, dtype = _operands(iq, ik, score_dtype)
    return _row_bytes(iq.shape[-1], n_parts, dtype)


SCORE_ARGS = ("score_dtype", "keys_fp8")


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret", *SCORE_ARGS))
def index_block_scores_blockmajor(iq, ik, q_pos, *, block_size, config=None, score_dtype="bfloat16", keys_fp8=False,
                                  interpret=None):
    """Kernel-native scores: fp32 [B, nb_pad, T_pad*Hi] (row t*Hi + h; padding rows/blocks -inf or junk).

    Also returns ``rowpos`` [B, T_pad*Hi] (q_pos per row, -1 for padding rows). When two key-block
    buffers do not fit in SMEM (fp32 inputs at block 256), the kernel runs at half the block size
    and adjacent half-block maxima are max-pooled (exact: the max over a block is the max of its
    halves' maxima, and ``-inf`` halves lie in the future). ``score_dtype`` / ``keys_fp8``: as
    :func:`m3jax.msa.reference.block_scores` (``"float8_e4m3fn"``: the fp8 indexer, an e4m3 wgmma).
    """
    _check_kernel("index_block_scores", iq, ik, q_pos, block_size, score_dtype)
    config = (config or IndexScoreConfig()).for_block(block_size, fused=False)
    if not _pipeline_steps(config.rows, _row_bytes_of(iq, ik, score_dtype), block_size, False, 0, config):
        if block_size % 16:
            raise ValueError(f"block_size {block_size} too large for SMEM and not halvable")
        half, rowpos = index_block_scores_blockmajor(iq, ik, q_pos, block_size=block_size // 2, config=config,
                                                     score_dtype=score_dtype, keys_fp8=keys_fp8, interpret=interpret)
        nb_half = half.shape[1] + half.shape[1] % 2
        half = jnp.pad(half, [(0, 0), (0, nb_half - half.shape[1]), (0, 0)], constant_values=NEG_INF)
        return jnp.max(half.reshape(half.shape[0], nb_half // 2, 2, half.shape[2]), axis=2), rowpos
    qs, ks, scales, rowpos, info, nb, _ = _prepare(iq, ik, q_pos, block_size, config.rows, score_dtype, keys_fp8)
    out = _kernel_call(qs, ks, scales, rowpos, info, s_len=ik.shape[1], block_size=block_size, nb=nb, config=config,
                       fused=False, topk=0, local_blocks=0, init_blocks=0, interpret=interpret)
    return out, rowpos


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret", *SCORE_ARGS))
def index_block_scores(iq, ik, q_pos, *, block_size, config=None, score_dtype="bfloat16", keys_fp8=False,
                       interpret=None):
    """fp32 [B, Hi, T, nb]; semantics of ``m3jax.msa.block_scores`` (``score_dtype``, ``keys_fp8`` too)."""
    out, _ = index_block_scores_blockmajor(iq, ik, q_pos, block_size=block_size, config=config,
                                           score_dtype=score_dtype, keys_fp8=keys_fp8, interpret=interpret)
    b, t, hi, _ = iq.shape  # checked by the call
    nb = -(-ik.shape[1] // block_size)
    out = out[:, :nb, : t * hi].reshape(b, nb, t, hi)
    return jnp.transpose(out, (0, 3, 2, 1))


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "local_blocks", "init_blocks", "force_in",
                                             "force_out", "config", "interpret", *SCORE_ARGS))
def index_select_blocks(iq, ik, q_pos, *, block_size, topk, local_blocks=1, init_blocks=0, force_in=(), force_out=(),
                        config=None, score_dtype="bfloat16", keys_fp8=False, interpret=None):
    """Scores + top-k: int32 [B, Hi, T, topk].

    ``config.fused_topk=True``: one kernel, the [T, nb] score matrix is never written (docs/KERNELS.md §2.8).
    Default: the score kernel writes block-major scores that the top-k kernel reads directly
    (faster: the fused insertion serialises with the wgmma and forces 64-row tiles for registers;
    benchmarks/RESULTS.md#index-score-tiles).

    Order: forced blocks first (own, own-1, ..., sinks), then descending score, ties to the lower
    id, ``-1`` padding: the same order as ``m3jax.msa.select_blocks``. ``score_dtype`` / ``keys_fp8``:
    as :func:`index_block_scores_blockmajor`.
    """
    _check_kernel("index_select_blocks", iq, ik, q_pos, block_size, score_dtype)
    b, t, hi, _ = iq.shape
    config = (config or IndexScoreConfig()).for_block(block_size, fused=True)
    row_bytes = _row_bytes_of(iq, ik, score_dtype)
    if not config.fused_topk or not _pipeline_steps(config.rows, row_bytes, block_size, True, topk, config):
        # Unfused (the default, faster as measured) or the fused kernel does not fit in SMEM:
        # block-major scores (half-block fallback if needed) + the top-k kernel, no transpose.
        scores, rowpos = index_block_scores_blockmajor(iq, ik, q_pos, block_size=block_size,
                                                       config=dataclasses.replace(config, fused_topk=False),
                                                       score_dtype=score_dtype, keys_fp8=keys_fp8, interpret=interpret)
        ids = select_blocks_blockmajor(scores, rowpos, block_size=block_size, topk=topk, local_blocks=local_blocks,
                                       init_blocks=init_blocks, force_in=force_in, force_out=force_out,
                                       interpret=interpret)
        ids = ids[:, :, : t * hi].reshape(b, topk, t, hi)
        return jnp.transpose(ids, (0, 3, 2, 1))
    qs, ks, scales, rowpos, info, nb, _ = _prepare(iq, ik, q_pos, block_size, config.rows, score_dtype, keys_fp8)
    ids = _kernel_call(qs, ks, scales, rowpos, info, s_len=ik.shape[1], block_size=block_size, nb=nb, config=config,
                       fused=True, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                       force_in=force_in, force_out=force_out, interpret=interpret)
    ids = ids[:, :, : t * hi].reshape(b, topk, t, hi)
    return jnp.transpose(ids, (0, 3, 2, 1))
