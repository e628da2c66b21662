"""Reference grouped matmul: ``jax.lax.ragged_dot`` (fp32 accumulation); same signature as the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax.layers import dequantize_mxfp8  # the MXFP8 format maths live beside MXFP8Weight
from m3jax.pallas.grouped_matmul.tiles import RowGroups


def grouped_matmul(lhs, rhs, group_sizes, *, out_dtype=None, config=None, interpret=None) -> jax.Array:
    """[M, N]: row r of ``lhs [M, K]`` times ``rhs[g(r)] [K, N]``; rows past sum(group_sizes) are zero.
    :class:`.tiles.RowGroups`: row r times ``rhs[ids[r]]`` (the rows sorted by group for ``ragged_dot``
    and put back); ``rhs`` a tuple of arrays: their groups one after another (concatenated here)."""
    del config, interpret
    if isinstance(rhs, tuple):
        rhs = jnp.concatenate(rhs, axis=0)
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, rhs.dtype))
    if isinstance(group_sizes, RowGroups):
        ids = group_sizes.ids.astype(jnp.int32)
        order = jnp.argsort(ids, stable=True)
        sizes = jnp.bincount(ids, length=rhs.shape[0]).astype(jnp.int32)
        out = jax.lax.ragged_dot(lhs[order], rhs, sizes, precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
        return jnp.zeros_like(out).at[order].set(out).astype(out_dtype)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def grouped_matmuls(lhs, weights, group_sizes, *, out_dtype=None, config=None, interpret=None):
    """:func:`grouped_matmul` of one ``lhs`` with each weight of ``weights`` (a list back for a list)."""
    outs = [grouped_matmul(lhs, w, group_sizes, out_dtype=out_dtype, config=config, interpret=interpret)
            for w in weights]
    return outs if isinstance(weights, list) else tuple(outs)


def grouped_matmul_mxfp8(lhs, values, scales, group_sizes, *, out_dtype=None, config=None, interpret=None) -> jax.Array:
    """The MXFP8-weight kernel's reference: dequantise to ``lhs``'s dtype, then :func:`grouped_matmul`."""
    return grouped_matmul(lhs, dequantize_mxfp8(values, scales, lhs.dtype), group_sizes,
                          out_dtype=out_dtype or lhs.dtype, config=config, interpret=interpret)


def grouped_matmuls_mxfp8(lhs, weights, group_sizes, *, out_dtype=None, config=None, interpret=None) -> tuple:
    """:func:`grouped_matmul_mxfp8` of one ``lhs`` with each ``(values, scales)`` of ``weights``."""
    return tuple(grouped_matmul_mxfp8(lhs, v, s, group_sizes, out_dtype=out_dtype, config=config, interpret=interpret)
                 for v, s in weights)


def gemv_launch_mxfp8(problems, *, out_dtype=None, interpret=None) -> tuple:
    """:func:`grouped_matmuls_mxfp8` per ``(lhs, weights, group_sizes, config)`` problem."""
    out_dtype = out_dtype or problems[0][0].dtype
    return tuple(grouped_matmuls_mxfp8(lhs, weights, sizes, out_dtype=out_dtype) for lhs, weights, sizes, _ in problems)


def dense_gemvs(lhs, weights, *, out_dtype=None, interpret=None) -> tuple:
    """``lhs @ w`` per weight of ``weights``, fp32 products and sums, rounded once to ``out_dtype``."""
    del interpret
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    return tuple(jnp.dot(lhs, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
                 .astype(out_dtype) for w in weights)
