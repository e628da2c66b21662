"""What the prefill index-score kernel's per-architecture modules share: :class:`RowMax`, the one part of
:mod:`.kernel` that differs per MMA (Hopper ``wgmma`` in :mod:`.hopper`, Blackwell ``tcgen05`` in
:mod:`.blackwell`). Its own module so that both import it and neither imports :mod:`.kernel`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class RowMax:
    """How a CTA turns one key block into its rows' maxima (the part that differs per MMA).

    ``row_max(q_smems, k_smems, scratch_refs, epilogue)`` -> fp32 [rows] in ``row_layout``: the products
    of the split pieces (``split_products``) of the Q tile [rows, Hx] and the key block [bs, Hx]
    (bf16, or e4m3 under the fp8 indexer) summed, ``epilogue(acc, col0, layout)`` (the fp8 scales and
    the causal mask) applied (when not None) to each accumulator piece it reads (columns from ``col0``,
    registers in ``layout``), then max-reduced over the key columns.
    ``scratch``: the scratch it needs after the kernel's own (``scratch_refs``, in that order).
    """

    row_layout: object
    scratch: tuple
    row_max: Callable
