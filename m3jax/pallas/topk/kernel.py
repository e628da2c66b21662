"""Mosaic GPU kernel: MSA top-k block selection per (batch, index head, query).

Design (Hopper): a CTA is one warpgroup owning a tile of 128 rows (row = one (token, index head)).
Scores arrive *block-major*, ``[B, nb_pad, R]`` (the layout the index-score kernel writes), so a
chunk of ``chunk`` block ids x 128 rows is one dense TMA box; ``plgpu.emit_pipeline`` streams the
chunks through SMEM. Each SMEM row (one block id, 128 rows) is loaded as one register vector with
one element per thread (``WG_STRIDED`` layout: thread i owns row i) and inserted into a running
per-row top-k list held in registers (``topk`` values + ``topk`` ids per thread; the branch-free
compare-and-swap insertion of ``select.insert``). Chunks past the tile's causal limit (all
``-inf``) are never loaded. Rows up to 8,192 blocks (1M tokens at block 128) are a longer
pipeline, not a different kernel. Few rows (decode: ``B * Hi * Q``, 4 at batch 1) leave most SMs
idle here; :mod:`.rowsplit` splits each row over a warpgroup instead.

Output order: forced blocks first (own, own-1, ..., init sinks), then descending score, ties to the
lower block id, ``-1`` right padding, i.e. exactly the order of ``m3jax.msa.select_blocks``.

Cost: ``5 * topk`` element-wise ops per (row, visible block); at 8K queries x 4 heads x 8,192
blocks and top-16 that is ~1.3e10 lane-ops, small beside the scoring GEMM at that shape
(benchmarks/RESULTS.md#topk-cost). What remains: skip the insertion for a chunk when no row's candidate beats its current
k-th value (a warpgroup-wide vote), which makes the typical cost ~ one compare per element.

Blackwell: nothing here uses the MMA; the port is the same kernel with a larger row tile per CTA
(more warpgroups, ``num_sms=148``); the quantised 16-bit key + ``redux.sync`` selection of MSA's
``m3_topk`` is the next step if this becomes a bottleneck there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from m3jax.pallas._backend import mosaic_kernel, pl, plgpu
from m3jax.pallas._common import check_dims
from m3jax.pallas.topk import select

NEG_INF = float("-inf")
ROWS = 128  # one warpgroup, one row per thread


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """``chunk``: block ids per pipeline step (SMEM tile chunk x 128 fp32); ``max_concurrent_steps``."""

    chunk: int = 32
    max_concurrent_steps: int = 3


def _layout():
    return plgpu.Layout.WG_STRIDED((ROWS,), 1)


def _kernel_call(scores_bm, rowpos, tile_max, *, block_size, topk, local_blocks, init_blocks, force_in, force_out,
                 config, interpret=None):
    b, nb_pad, r_pad = scores_bm.shape
    chunk = config.chunk
    n_tiles = r_pad // ROWS

    def body(s_ref, rowpos_ref, tmax_ref, out_ref, rp_smem, o_smem, bar):
        bi = jax.lax.axis_index("b")
        ti = jax.lax.axis_index("tile")
        r0 = ti * ROWS
        nvis = jnp.clip(jnp.floor_divide(tmax_ref[bi, ti], block_size) + 1, 0, nb_pad)
        n_chunks = -(-nvis // chunk)
        plgpu.copy_gmem_to_smem(rowpos_ref.at[bi, pl.ds(r0, ROWS)], rp_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        rowpos = plgpu.load(rp_smem, layout=_layout())

        init = (
            tuple(jnp.full((ROWS,), NEG_INF, jnp.float32) for _ in range(topk)),
            tuple(jnp.full((ROWS,), -1, jnp.int32) for _ in range(topk)),
        )
        init = jax.tree.map(lambda x: plgpu.layout_cast(x, _layout()), init)

        def step(idx, s_smem, carry):
            c = idx[0]

            def one(cc, carry):
                x = select.smem_candidate(s_smem.at[cc], rowpos, c * chunk + cc, layout=_layout(),
                                          block_size=block_size, local_blocks=local_blocks, init_blocks=init_blocks,
                                          force_in=force_in, force_out=force_out)
                return select.insert(*carry, x, c * chunk + cc)

            carry = jax.lax.fori_loop(0, chunk, one, carry)
            # Generic SMEM reads must be ordered before the pipeline's next TMA into this slot.
            plgpu.commit_smem()
            return carry

        _, ids = plgpu.emit_pipeline(
            step,
            grid=(n_chunks,),
            in_specs=[plgpu.BlockSpec((chunk, ROWS), lambda c: (c, ti))],
            max_concurrent_steps=config.max_concurrent_steps,
            init_carry=init,
        )(s_ref.at[bi])
        for i in range(topk):
            o_smem[i] = ids[i]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[bi, :, pl.ds(r0, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=jax.ShapeDtypeStruct((b, topk, r_pad), jnp.int32),
        grid=(b, n_tiles),
        grid_names=("b", "tile"),
        scratch_types=[
            plgpu.SMEM((ROWS,), jnp.int32),
            plgpu.SMEM((topk, ROWS), jnp.int32),
            plgpu.Barrier(num_barriers=1),
        ],
    )
    return kern(scores_bm, rowpos, tile_max)


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "local_blocks", "init_blocks", "force_in",
                                             "force_out", "config", "interpret"))
def select_blocks_blockmajor(scores_bm, rowpos, *, block_size, topk, local_blocks=1, init_blocks=0, force_in=(),
                             force_out=(), config=None, interpret=None):
    """Top-k over block-major scores ``[B, nb', R]`` (row r's positions in ``rowpos [B, R]``; -1 = padding).

    Returns int32 ``[B, topk, R_pad]`` (R_pad = R rounded up to 128).
    """
    check_dims("select_blocks_blockmajor", scores_bm=(scores_bm, "B nb R"), rowpos=(rowpos, "B R"))
    if topk < 1:
        raise ValueError(f"select_blocks_blockmajor: topk must be >= 1, got {topk}")
    config = config or TopkConfig()
    b, nb, r = scores_bm.shape
    chunk = config.chunk
    nb_pad = -(-nb // chunk) * chunk
    r_pad = -(-r // ROWS) * ROWS
    if (nb_pad, r_pad) != (nb, r):
        scores_bm = jnp.pad(scores_bm, [(0, 0), (0, nb_pad - nb), (0, r_pad - r)], constant_values=NEG_INF)
    rowpos = jnp.pad(rowpos.astype(jnp.int32), [(0, 0), (0, r_pad - r)], constant_values=-1)
    tile_max = jnp.max(rowpos.reshape(b, r_pad // ROWS, ROWS), axis=-1)
    # Blocks past the real nb are padding (-inf): never forced since they lie after every own block.
    return _kernel_call(scores_bm, rowpos, tile_max, block_size=block_size, topk=topk, local_blocks=local_blocks,
                        init_blocks=init_blocks, force_in=force_in, force_out=force_out, config=config,
                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_size", "topk", "local_blocks", "init_blocks", "force_in",
                                             "force_out", "config", "interpret"))
def select_blocks(scores, q_pos, *, block_size, topk, local_blocks=1, init_blocks=0, force_in=(), force_out=(),
                  config=None, interpret=None):
    """int32 [B, Hi, T, topk] from fp32 scores [B, Hi, T, nb] (one XLA transpose to block-major first)."""
    b, hi, t, nb = scores.shape
    scores_bm = jnp.transpose(scores, (0, 3, 2, 1)).reshape(b, nb, t * hi)
    rowpos = jnp.repeat(q_pos.astype(jnp.int32), hi, axis=1)
    ids = select_blocks_blockmajor(scores_bm, rowpos, block_size=block_size, topk=topk, local_blocks=local_blocks,
                                   init_blocks=init_blocks, force_in=force_in, force_out=force_out, config=config,
                                   interpret=interpret)
    ids = ids[:, :, : t * hi].reshape(b, topk, t, hi)
    return jnp.transpose(ids, (0, 3, 2, 1))
