"""How a CTA of the prefill index-score kernel turns one key block into its rows' maxima: the one part
of :mod:`.kernel` that differs per MMA (Hopper ``wgmma`` here, Blackwell ``tcgen05`` in :mod:`.blackwell`).
Its own module so that both variants import it and neither imports the other's kernel module."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from m3jax.pallas._backend import pl, plgpu
from m3jax.pallas._common import split_products


@dataclasses.dataclass(frozen=True)
class RowMax:
    """How a CTA turns one key block into its rows' maxima (the part that differs per MMA).

    ``row_max(q_smems, k_smems, scratch_refs, mask)`` -> fp32 [rows] in ``row_layout``: the products
    of the split pieces (``split_products``) of the Q tile [rows, Hx] and the key block [bs, Hx]
    summed, ``mask(acc, col0, layout)`` applied (when not None) to each accumulator piece it reads
    (columns from ``col0``, registers in ``layout``), then max-reduced over the key columns.
    ``scratch``: the scratch it needs after the kernel's own (``scratch_refs``, in that order).
    """

    row_layout: object
    scratch: tuple
    row_max: Callable


def wgmma_row_max(n_parts, rows, bs):
    """Hopper: wgmma into a register accumulator [rows, bs], masked and reduced in registers."""

    def row_max(q_smems, k_smems, _, mask):
        def mma(acc_ref):
            # Smallest products first: they are summed before the large ones round the accumulator.
            for i, jp in reversed(split_products(n_parts)):
                plgpu.wgmma(acc_ref, q_smems[i], k_smems[jp].transpose((1, 0)))
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((rows, bs), jnp.float32))
        if mask is not None:
            acc = mask(acc, 0, plgpu.Layout.WGMMA)
        return acc.max(axis=1)

    return RowMax(plgpu.Layout.WGMMA.reduce(1), (), row_max)
