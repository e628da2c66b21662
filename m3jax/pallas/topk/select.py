"""Register-level top-k helpers shared by the two top-k kernels and the fused index-score + top-k kernel.

The block-major and fused kernels see a row tile of R rows (one (batch, query token, index head)
each) as a set of 1-D register vectors of length R, one vector per block id ``j`` in increasing
``j`` (the row-split kernel: one row's 128 lanes, lane i holding block ``c * 128 + i``). A running
top-k list per row is kept as ``k`` value vectors and ``k`` id vectors, sorted by descending value;
each new candidate ``(x, j)`` is inserted by one compare per slot and a shift of the entries
below the insertion point (``5 k`` element-wise ops per candidate, no data-dependent control flow).
Because candidates arrive in increasing block id and the comparison is strict (``>``), an equal
score never displaces an earlier (lower) id: ties go to the lower block id, as in
``m3jax.msa.select_blocks``. ``-0.0`` and ``+0.0`` compare equal, so they tie too.

Forced blocks (the own block, ``local_blocks - 1`` before it, ``init_blocks`` sinks, then the
``force_in`` intervention) get the same huge finite priorities as the reference (``1e38 + p * 1e36``
with own > own-1 > ... > sinks > force_in), so they take the first slots in the reference order;
``force_out`` blocks score -inf as in the reference. Empty slots hold ``(-inf, -1)``; a ``-inf``
candidate (a block wholly in the future) never enters, which yields the ``-1`` right padding.
The emitted order is therefore exactly the reference order: forced blocks first (own, own-1, ...,
sinks), then descending score, ties to the lower id, then ``-1``.
"""

from __future__ import annotations

import jax.numpy as jnp

from m3jax.msa.reference import forced_out, forced_priority, rank_scores
from m3jax.pallas._backend import plgpu


def forced_candidate(score, rowpos, j, *, block_size: int, local_blocks: int, init_blocks: int,
                     force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = ()):
    """The value that enters the top-k list for block ``j`` (a traced int32 scalar) per row: the
    reference's own ranking (:func:`m3jax.msa.reference.rank_scores` after the ``force_out`` and with
    the ``force_in`` interventions, static block ids) on the row's register vector."""
    dist = jnp.floor_divide(rowpos, block_size) - j  # >= 0 for blocks at or before the own block
    return ranked_candidate(score, dist, j, local_blocks=local_blocks, init_blocks=init_blocks, force_in=force_in,
                            force_out=force_out)


def ranked_candidate(score, dist, j, *, local_blocks: int, init_blocks: int, force_in: tuple[int, ...] = (),
                     force_out: tuple[int, ...] = ()):
    """:func:`forced_candidate` given each row's distance ``dist = own block - j`` instead of its
    position (a kernel that visits many blocks per row computes the own block once: the integer
    division is several instructions on the GPU)."""
    prio = forced_priority(dist, j, local_blocks=local_blocks, init_blocks=init_blocks, force_in=force_in)
    return rank_scores(forced_out(score, dist, j, force_out), prio)


def may_force(j, pos_lo, pos_hi, *, block_size: int, local_blocks: int, init_blocks: int,
              force_in: tuple[int, ...] = ()):
    """Whether block ``j`` (a traced int32 scalar) can get a forced priority (:func:`forced_candidate`
    above its score) in some row whose position lies in ``[pos_lo, pos_hi]`` (scalars): a scalar, so
    a kernel can branch on it uniformly. The forced blocks are the own block and the
    ``local_blocks - 1`` before it of some row, or a sink / ``force_in`` block at or before the last
    row's own block; exact for ``local_blocks >= 1`` (with 0 it also says yes for the blocks after
    the first row's own block up to the last row's: a caller needs only that it never says no for
    a forced block). ``force_out`` only lowers a value, so it needs no branch."""
    own_lo, own_hi = jnp.floor_divide(pos_lo, block_size), jnp.floor_divide(pos_hi, block_size)
    # some row's own block o in [own_lo, own_hi] has 0 <= o - j < local_blocks (given j <= own_hi)
    forced = j > own_lo - local_blocks
    if init_blocks:
        forced = forced | (j < init_blocks)
    for b in force_in:
        forced = forced | (j == b)
    return forced & (j <= own_hi)


def insert(vals, ids, x, j):
    """Insert candidate ``x`` (vector) with block id ``j`` (scalar) into the sorted lists.

    ``g_i = x > v_i`` is monotone in ``i`` (the list is sorted descending), so the new list is
    ``v_i`` above the insertion point, ``x`` at it and ``v_{i-1}`` (shifted down) below it.
    """
    xi = jnp.full(x.shape, j, jnp.int32)
    new_vals, new_ids = [], []
    prev_g = prev_v = prev_i = None
    for v, i in zip(vals, ids):
        g = x > v
        if prev_g is None:
            nv, ni = jnp.where(g, x, v), jnp.where(g, xi, i)
        else:
            nv = jnp.where(g, jnp.where(prev_g, prev_v, x), v)
            ni = jnp.where(g, jnp.where(prev_g, prev_i, xi), i)
        new_vals.append(nv)
        new_ids.append(ni)
        prev_g, prev_v, prev_i = g, v, i
    return tuple(new_vals), tuple(new_ids)


def smem_candidate(row_ref, rowpos, j, *, layout, block_size: int, local_blocks: int, init_blocks: int,
                   force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = (), scale=None, own=None):
    """Load one SMEM row of scores (one element per thread in ``layout``) for block id(s) ``j`` and give
    forced blocks their priorities: the candidate :func:`insert` takes. ``scale`` (a scalar):
    multiply the scores first; ``own`` (the row's own block, a scalar): blocks after it score ``-inf``
    whatever the row holds there (scores read where the scoring kernel wrote them, blocks past the
    live pages never written)."""
    x = plgpu.load(row_ref, layout=layout)
    if scale is not None:
        x = x * scale
    if own is not None:
        x = jnp.where(j <= own, x, -jnp.inf)
    return forced_candidate(x, rowpos, j, block_size=block_size, local_blocks=local_blocks, init_blocks=init_blocks,
                            force_in=force_in, force_out=force_out)
