"""What the Mosaic GPU kernels share: the fp32 -> bf16 (hi, lo) split and the SMEM swizzle layout.

The LSE merge and the forced-block priority are MSA maths and live in :mod:`m3jax.msa.reference`,
which the kernels and their references import.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import plgpu


def bf16_split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 x -> bf16 (hi, lo) with hi = bf16(x) (nearest even) and lo = bf16(x - hi), XLA side.

    Products of the parts (hi.hi + hi.lo + lo.hi, "bf16x3") carry ~16 mantissa bits, enough for
    fp32-exact selections and attention at the tolerances of docs/MSA.md §4.3. The rounding is done on
    the bits: with XLA's default ``xla_allow_excess_precision`` the GPU compiler may drop an
    f32 -> bf16 -> f32 round trip, which made ``x - f32(bf16(x))`` zero on the H200 (the fp32 path
    then had bf16-level error).
    """
    x = x.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    hi = lax.bitcast_convert_type(rounded, jnp.float32)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def split_parts(x: jax.Array) -> tuple[jax.Array, ...]:
    """16-bit arrays pass through as one part; fp32 becomes the two parts of :func:`bf16_split`."""
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return (x,)
    return bf16_split(x)


def bf16_split_in_kernel(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """In-kernel fp32 -> bf16 (hi, lo): Mosaic GPU lowers the casts as written (XLA never sees them)."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def swizzle_transforms(minor: int, itemsize: int = 2) -> tuple:
    """SMEM tiling + swizzle for tiles whose rows hold ``minor`` elements of ``itemsize`` bytes: the
    widest swizzle (<= 128 B) the row allows, in 8-row tiles, as wgmma and TMA expect."""
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)  # find_swizzle takes the row in bits
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
