"""MSA top-k block selection (docs/MSA.md §1.3, docs/KERNELS.md §2.3): two Mosaic GPU kernels and a
pure-jnp reference.

``select_blocks(scores, q_pos, *, block_size, topk, local_blocks=1, init_blocks=0, force_in=(),
force_out=(), implementation="pallas", config=None)`` -> int32 ``[B, Hi, T, topk]`` from fp32 scores
``[B, Hi, T, nb]``. Every implementation emits the reference order (forced own/local/sink blocks
first, then the ``force_in`` blocks, then descending score with ties to the lower block id, then
``-1``; ``force_out`` blocks never, unless forced: the interventions of ``m3jax.msa.select_blocks``,
static tuples of block ids).

Implementations: ``"pallas_blockmajor"`` (:mod:`.kernel`: one thread per row, 128 rows per CTA,
for prefill; ``config`` is its ``TopkConfig``), ``"pallas_rowsplit"`` (:mod:`.rowsplit`: one CTA
per row, its blocks split over 128 threads and tree-merged, for decode), ``"pallas"`` (the
row-split kernel up to ``ROWSPLIT_MAX_ROWS`` rows when a row fits in one CTA's SMEM, else the
block-major one) and ``"reference"`` (``m3jax.msa.select_blocks``). ``select_blocks_blockmajor``
takes the index-score kernel's block-major ``[B, nb, T*Hi]`` scores directly (no transpose), and
``select_blocks_rows`` (the row-split kernel) the decode scoring kernel's rows as written.
"""

from __future__ import annotations

from m3jax.pallas._common import check_dims
from m3jax.pallas.topk import kernel as _kernel
from m3jax.pallas.topk import reference as _reference
from m3jax.pallas.topk import rowsplit as _rowsplit
from m3jax.pallas.topk.kernel import TopkConfig, select_blocks_blockmajor
from m3jax.pallas.topk.rowsplit import select_blocks_rows

__all__ = ["ROWSPLIT_MAX_ROWS", "TopkConfig", "select_blocks", "select_blocks_blockmajor", "select_blocks_rows"]

# ~4 waves of one-row CTAs on 132 SMs: by op counts the row-split kernel (nb/128 insertions + 7 merge
# rounds per row) is faster than the block-major one (nb sequential insertions per CTA) up to here,
# about even at nb = 128 (not yet measured).
ROWSPLIT_MAX_ROWS = 512


def takes_rowsplit(rows: int, nb: int, topk: int) -> bool:
    """Whether ``implementation="pallas"`` takes the row-split kernel for ``rows`` rows of ``nb`` blocks."""
    return rows <= ROWSPLIT_MAX_ROWS and _rowsplit.unsupported_reason(nb, topk) is None


def select_blocks(scores, q_pos, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0,
                  force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = (), implementation: str = "pallas",
                  config=None):
    kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
              force_in=tuple(force_in), force_out=tuple(force_out))
    check_dims("select_blocks", scores=(scores, "B Hi T nb"), q_pos=(q_pos, "B T"))
    if topk < 1:
        raise ValueError(f"select_blocks: topk must be >= 1, got {topk}")
    if implementation == "pallas":
        b, hi, t, nb = scores.shape
        implementation = "pallas_rowsplit" if takes_rowsplit(b * hi * t, nb, topk) else "pallas_blockmajor"
    if implementation == "pallas_rowsplit":
        return _rowsplit.select_blocks(scores, q_pos, **kw)
    if implementation == "pallas_blockmajor":
        return _kernel.select_blocks(scores, q_pos, config=config, **kw)
    if implementation == "reference":
        return _reference.select_blocks(scores, q_pos, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")
