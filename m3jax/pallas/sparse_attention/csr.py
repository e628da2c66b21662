"""On-device inversion {query -> selected KV blocks} => {KV block -> queries} (docs/KERNELS.md §2.5).

Everything here is jnp with static shapes (no host sync): capacities are bounds computed from the
input shapes, and the number of live entries travels as device scalars.

Edge space. Per KV head ``h`` every valid ``block_idx[b, h, t, slot]`` is one *edge* (query ``t`` of
batch ``b`` selected block ``blk`` in slot ``slot``). Edges are sorted by row ``r = b * nb + blk``
(stable in ``t``), each row is padded to a multiple of ``tq`` (the query tokens of one packed MMA
tile), and the padded row segments are laid end to end: padded edge ``e`` of head ``h`` owns rows
``[e * G, (e + 1) * G)`` of the kernel's staging buffers ``o_stage[h]`` / ``lse_stage[h]``. A tile is
``tq`` consecutive padded edges of one row; a work item is up to ``tiles_per_item`` consecutive
tiles of one row (the K/V block is loaded once per work item).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVMajorWork:
    """Device arrays describing the KV-block-major work (all int32).

    items:  [n_cap, 5] (kv_head, batch, block, first_tile, n_tiles); rows >= n_items are unused.
    n_items: [1] number of live work items.
    qtok:   [K, E_pad] query token of each padded edge (padding edges: token 0 of the row's batch,
            unmasked; the combine never reads their outputs).
    qlim:   [K, E_pad] last visible key column inside the block: q_pos - block * block_size
            (>= block_size - 1 means "no mask"; only the query's own block is ever partial).
    epos:   [B, K, T, topk] padded edge of (query, slot), -1 for empty slots (what the combine reads).
    row_items: [K, B * nb, 2] (first item, item count) of each row: the items whose partial sums make
            up that row's result (the backward's dK / dV reduce); count 0 for a row nobody selected.
    """

    items: jax.Array
    n_items: jax.Array
    qtok: jax.Array
    qlim: jax.Array
    epos: jax.Array
    row_items: jax.Array


def capacities(b: int, t: int, kh: int, nb: int, topk: int, tq: int, tiles_per_item: int) -> tuple[int, int]:
    """(E_pad, n_cap): padded edges per KV head and the work-item capacity (static)."""
    rows = b * nb
    e_pad = b * t * topk + rows * (tq - 1)
    e_pad = -(-e_pad // tq) * tq
    n_tiles = e_pad // tq
    n_cap = kh * (n_tiles // tiles_per_item + rows)
    return e_pad, n_cap


def build_work(
    block_idx: jax.Array, q_pos: jax.Array, *, num_blocks: int, block_size: int, tq: int, tiles_per_item: int
) -> KVMajorWork:
    """Build the CSR + work list for :func:`kernel.kv_major_forward` (pure jnp, jit-able)."""
    b, kh, t, topk = block_idx.shape
    nb = num_blocks
    rows = b * nb
    e_pad, n_cap = capacities(b, t, kh, nb, topk, tq, tiles_per_item)
    valid = block_idx >= 0
    blk = jnp.where(valid, block_idx, 0)
    bi = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
    ti = jnp.arange(t, dtype=jnp.int32)[None, None, :, None]
    row = jnp.where(valid, bi * nb + blk, rows)  # invalid edges sort last (row id == rows)
    # Per KV head: flatten (b, t, slot) in that order so a stable sort keeps t ascending in a row.
    row_h = jnp.moveaxis(row, 1, 0).reshape(kh, -1)  # [K, E]
    tok_h = jnp.moveaxis(jnp.broadcast_to(ti, block_idx.shape), 1, 0).reshape(kh, -1)
    qp = jnp.broadcast_to(q_pos[:, None, :, None], block_idx.shape)
    lim_h = jnp.moveaxis(qp - blk * block_size, 1, 0).reshape(kh, -1)
    n_edges = row_h.shape[1]
    order = jnp.argsort(row_h, axis=1, stable=True)
    srow = jnp.take_along_axis(row_h, order, axis=1)
    stok = jnp.take_along_axis(tok_h, order, axis=1)
    slim = jnp.take_along_axis(lim_h, order, axis=1)

    counts = jax.vmap(lambda r: jnp.bincount(r, length=rows + 1))(row_h)[:, :rows]  # [K, R]
    start = jnp.cumsum(counts, axis=1) - counts  # unpadded row starts (sorted edge space)
    pcount = -(-counts // tq) * tq
    pstart = jnp.cumsum(pcount, axis=1) - pcount  # padded row starts
    srow_c = jnp.minimum(srow, rows - 1)
    rank = jnp.arange(n_edges, dtype=jnp.int32)[None] - jnp.take_along_axis(start, srow_c, axis=1)
    spos = jnp.take_along_axis(pstart, srow_c, axis=1) + rank
    live = srow < rows
    spos = jnp.where(live, spos, e_pad)  # dropped by the scatter below

    hi = jnp.arange(kh)[:, None]
    # Padding edges load token 0 of the row's batch (always in bounds) with no mask; their outputs
    # land in staging rows that the combine never reads.
    qtok = jnp.zeros((kh, e_pad), jnp.int32).at[hi, spos].set(stok, mode="drop")
    qlim = jnp.full((kh, e_pad), block_size, jnp.int32).at[hi, spos].set(slim, mode="drop")

    # Inverse map for the combine: (b, h, t, slot) -> padded edge.
    epos_h = jnp.zeros((kh, n_edges), jnp.int32).at[hi, order].set(jnp.where(live, spos, -1))
    epos = jnp.moveaxis(epos_h.reshape(kh, b, t, topk), 0, 1)

    # Work items: each row's tiles in chunks of tiles_per_item.
    ntiles = pcount // tq  # [K, R]
    nitem = -(-ntiles // tiles_per_item)
    flat_n = nitem.reshape(-1)
    iend = jnp.cumsum(flat_n)
    istart = iend - flat_n
    n_items = iend[-1:]
    w = jnp.arange(n_cap, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(iend, w, side="right"), 0, kh * rows - 1)
    j = w - istart[owner]
    h_of = owner // rows
    r_of = owner % rows
    first_tile = pstart.reshape(-1)[owner] // tq + j * tiles_per_item
    nt = jnp.minimum(tiles_per_item, ntiles.reshape(-1)[owner] - j * tiles_per_item)
    items = jnp.stack([h_of, r_of // nb, r_of % nb, first_tile, nt], axis=1).astype(jnp.int32)
    row_items = jnp.stack([istart, flat_n], axis=1).reshape(kh, rows, 2).astype(jnp.int32)
    return KVMajorWork(items=items, n_items=n_items.astype(jnp.int32), qtok=qtok, qlim=qlim, epos=epos,
                       row_items=row_items)
