"""Grouped GEMM for the MoE experts (``jax.lax.ragged_dot`` semantics): Mosaic GPU kernel + reference.

``grouped_matmul(lhs, rhs, group_sizes, *, out_dtype=None, implementation="pallas", config=None)``
returns ``[M, N]`` with row r = ``lhs[r] @ rhs[group of r]`` (rows sorted by group, rows past
``sum(group_sizes)`` zero). ``unsupported_reason(m, k, n, g, config)`` says why the kernel cannot
take a shape (None when it can); ``implementation="reference"`` is ``jax.lax.ragged_dot``.
"""

from __future__ import annotations

from m3jax.pallas.grouped_matmul import kernel as _kernel
from m3jax.pallas.grouped_matmul import reference as _reference
from m3jax.pallas.grouped_matmul.kernel import GroupedMatmulConfig, tile_schedule, unsupported_reason

__all__ = ["GroupedMatmulConfig", "grouped_matmul", "tile_schedule", "unsupported_reason"]


def grouped_matmul(lhs, rhs, group_sizes, *, out_dtype=None, implementation: str = "pallas", config=None,
                   interpret=None):
    kw = dict(out_dtype=out_dtype, config=config, interpret=interpret)
    if implementation == "pallas":
        return _kernel.grouped_matmul(lhs, rhs, group_sizes, **kw)
    if implementation == "reference":
        return _reference.grouped_matmul(lhs, rhs, group_sizes, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")
