"""Reference grouped matmul: ``jax.lax.ragged_dot`` (fp32 accumulation); same signature as the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(lhs, rhs, group_sizes, *, out_dtype=None, config=None, interpret=None) -> jax.Array:
    """[M, N]: row r of ``lhs [M, K]`` times ``rhs[g(r)] [K, N]``; rows past sum(group_sizes) are zero."""
    del config, interpret
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs.dtype, rhs.dtype))
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    return out.astype(out_dtype)
