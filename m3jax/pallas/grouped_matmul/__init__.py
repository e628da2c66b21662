"""Grouped GEMM for the MoE experts (``jax.lax.ragged_dot`` semantics): Mosaic GPU kernel + reference.

``grouped_matmul(lhs, rhs, group_sizes, *, out_dtype=None, implementation="pallas", config=None)``
returns ``[M, N]`` with row r = ``lhs[r] @ rhs[group of r]`` (rows sorted by group, rows past
``sum(group_sizes)`` zero; ``RowGroups(ids)`` instead: row r times ``rhs[ids[r]]``, rows in any order, on
the pipeline and gemv schedules, ``rhs`` then also a tuple of arrays whose groups follow one another, run in
one launch). ``grouped_matmuls(lhs, (w, ...), group_sizes, ...)``: several such weights of one shape times the
same rows in one launch of the pipeline schedule. ``unsupported_reason(m, k, n, g, config)`` says why the kernel
cannot take a shape (None when it can); ``implementation="reference"`` is ``jax.lax.ragged_dot``.

``grouped_matmul_mxfp8(lhs, values, scales, group_sizes, ...)``: the same with MXFP8 weights (float8_e4m3fn
``values [G, K, N]`` + uint8 E8M0 ``scales [G, K / 32, N]``), dequantised per tile in the kernel; its
reference dequantises (``dequantize_mxfp8``) and multiplies. ``mxfp8_unsupported_reason`` its limits.
``grouped_matmuls_mxfp8(lhs, ((values, scales), ...), group_sizes, ...)``: several MXFP8 weights of one
shape times the same rows (an MLP's gate and up), one launch on the gemv schedule.
``gemv_launch_mxfp8(((lhs, weights, group_sizes, config), ...))``: several such calls, each its own rows
and groups, in one gemv launch (a decode step's shared expert beside the routed experts).
``dense_gemvs(lhs, (w, ...))``: a few rows times several bf16 dense weights ``[K, N_i]`` in one gemv
launch (a decode step's attention projections); ``dense_gemv_unsupported_reason(m, k, n, dtype)``.

``GroupedMatmulConfig.schedule`` picks the kernel: ``"pipeline"`` (:mod:`.kernel`),
``"warp_specialized"`` (:mod:`.persistent`; its prefill tiles ``PREFILL_ROWS256`` and ``PREFILL_ROWS384``,
bf16's, and ``PREFILL_128X256``, MXFP8's) or, MXFP8 weights at decode rows, ``"gemv"`` (:mod:`.gemv`);
``layer_config`` is the MoE layer's choice per shape.
"""

from __future__ import annotations

from m3jax.pallas.grouped_matmul import kernel as _kernel
from m3jax.pallas.grouped_matmul import reference as _reference
from m3jax.pallas.grouped_matmul.kernel import (
    PREFILL_128X256,
    PREFILL_ROWS256,
    PREFILL_ROWS384,
    GroupedMatmulConfig,
    layer_config,
    mxfp8_unsupported_reason,
    tile_schedule,
    unsupported_reason,
)
from m3jax.pallas.grouped_matmul.gemv import dense_unsupported_reason as dense_gemv_unsupported_reason
from m3jax.pallas.grouped_matmul.reference import dequantize_mxfp8
from m3jax.pallas.grouped_matmul.tiles import RowGroups

__all__ = ["PREFILL_128X256", "PREFILL_ROWS256", "PREFILL_ROWS384", "GroupedMatmulConfig", "RowGroups",
           "dense_gemv_unsupported_reason", "dense_gemvs", "dequantize_mxfp8", "gemv_launch_mxfp8", "grouped_matmul",
           "grouped_matmul_mxfp8", "grouped_matmuls", "grouped_matmuls_mxfp8", "layer_config",
           "mxfp8_unsupported_reason", "tile_schedule", "unsupported_reason"]


def grouped_matmul(lhs, rhs, group_sizes, *, out_dtype=None, implementation: str = "pallas", config=None,
                   interpret=None):
    kw = {"out_dtype": out_dtype, "config": config, "interpret": interpret}
    if implementation == "pallas":
        return _kernel.grouped_matmul(lhs, rhs, group_sizes, **kw)
    if implementation == "reference":
        return _reference.grouped_matmul(lhs, rhs, group_sizes, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")


def grouped_matmuls(lhs, weights, group_sizes, *, out_dtype=None, implementation: str = "pallas", config=None,
                    interpret=None) -> tuple:
    kw = {"out_dtype": out_dtype, "config": config, "interpret": interpret}
    if implementation == "pallas":
        return _kernel.grouped_matmuls(lhs, tuple(weights), group_sizes, **kw)
    if implementation == "reference":
        return _reference.grouped_matmuls(lhs, tuple(weights), group_sizes, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")


def grouped_matmul_mxfp8(lhs, values, scales, group_sizes, *, out_dtype=None, implementation: str = "pallas",
                         config=None, interpret=None):
    kw = {"out_dtype": out_dtype, "config": config, "interpret": interpret}
    if implementation == "pallas":
        return _kernel.grouped_matmul_mxfp8(lhs, values, scales, group_sizes, **kw)
    if implementation == "reference":
        return _reference.grouped_matmul_mxfp8(lhs, values, scales, group_sizes, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")


def grouped_matmuls_mxfp8(lhs, weights, group_sizes, *, out_dtype=None, implementation: str = "pallas", config=None,
                          interpret=None) -> tuple:
    kw = {"out_dtype": out_dtype, "config": config, "interpret": interpret}
    weights = tuple((v, s) for v, s in weights)
    if implementation == "pallas":
        return _kernel.grouped_matmuls_mxfp8(lhs, weights, group_sizes, **kw)
    if implementation == "reference":
        return _reference.grouped_matmuls_mxfp8(lhs, weights, group_sizes, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")


def gemv_launch_mxfp8(problems, *, out_dtype=None, implementation: str = "pallas", interpret=None) -> tuple:
    problems = tuple((lhs, tuple((v, s) for v, s in weights), sizes, config) for lhs, weights, sizes, config in problems)
    if implementation == "pallas":
        return _kernel.gemv_launch_mxfp8(problems, out_dtype=out_dtype, interpret=interpret)
    if implementation == "reference":
        return _reference.gemv_launch_mxfp8(problems, out_dtype=out_dtype)
    raise ValueError(f"unknown implementation {implementation!r}")


def dense_gemvs(lhs, weights, *, out_dtype=None, implementation: str = "pallas", interpret=None) -> tuple:
    weights = tuple(weights)
    if implementation == "pallas":
        return _kernel.dense_gemvs(lhs, weights, out_dtype=out_dtype, interpret=interpret)
    if implementation == "reference":
        return _reference.dense_gemvs(lhs, weights, out_dtype=out_dtype)
    raise ValueError(f"unknown implementation {implementation!r}")
