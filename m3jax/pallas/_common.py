"""What the Mosaic GPU kernels share: the fp32 -> bf16 (hi, lo) split and the SMEM swizzle layout.

The LSE merge and the forced-block priority are MSA maths and live in :mod:`m3jax.msa.reference`,
which the kernels and their references import.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import interpreting, plgpu


def bf16_split(x: jax.Array, parts: int = 2) -> tuple[jax.Array, ...]:
    """fp32 x -> ``parts`` bf16 pieces, XLA side: hi = bf16(x) (nearest even), then each next piece
    rounds what the earlier ones left (the last one by a plain cast), so x ~= hi + lo (+ lo2).

    Two parts: the products hi.hi + hi.lo + lo.hi ("bf16x3", :func:`split_products`) carry ~16
    mantissa bits, enough for attention at the tolerances of docs/MSA.md §4.3. Three parts: the six
    products of :func:`split_products` (3) carry ~24 bits, i.e. fp32 accuracy, which index scores
    need: they decide selections, and a 2^-16 error flips near-tied blocks that fp32 keeps apart.
    The rounding is done on the bits: with XLA's default ``xla_allow_excess_precision`` the GPU
    compiler may drop an f32 -> bf16 -> f32 round trip, which made ``x - f32(bf16(x))`` zero on the
    H200 (the fp32 path then had bf16-level error).
    """
    rest = x.astype(jnp.float32)
    out = []
    for _ in range(parts - 1):
        bits = lax.bitcast_convert_type(rest, jnp.uint32)
        rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
        hi = lax.bitcast_convert_type(rounded, jnp.float32)
        out.append(hi.astype(jnp.bfloat16))
        rest = rest - hi
    return (*out, rest.astype(jnp.bfloat16))


def split_products(n_parts: int) -> tuple[tuple[int, int], ...]:
    """The part products (i, j) of two split operands that reach the accuracy of the split: those
    with i + j < n_parts (1 part: 1 product, 2 parts: 3 ("bf16x3"), 3 parts: 6), largest first."""
    return tuple((i, s - i) for s in range(n_parts) for i in range(s + 1))


def split_parts(x: jax.Array, parts: int = 2) -> tuple[jax.Array, ...]:
    """16-bit arrays pass through as one part; fp32 becomes the ``parts`` pieces of :func:`bf16_split`."""
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return (x,)
    return bf16_split(x, parts)


def bf16_split_in_kernel(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """In-kernel fp32 -> bf16 (hi, lo): Mosaic GPU lowers the casts as written. In interpret mode the
    body is XLA ops, and the GPU compiler dropped the round trip (lo = 0: the Blackwell decode kernel
    interpreted on the H200 was off by 5e-4 in fp32, and exact with ``--xla_allow_excess_precision=false``),
    so there the split rounds on the bits as :func:`bf16_split` does (the same values)."""
    if interpreting():
        return bf16_split(x, 2)
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def swizzle_transforms(minor: int, itemsize: int = 2) -> tuple:
    """SMEM tiling + swizzle for tiles whose rows hold ``minor`` elements of ``itemsize`` bytes: the
    widest swizzle (<= 128 B) the row allows, in 8-row tiles, as wgmma and TMA expect."""
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)  # find_swizzle takes the row in bits
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
