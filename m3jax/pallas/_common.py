"""What the Mosaic GPU kernels share: the fp32 -> bf16 (hi, lo) split, the SMEM swizzle layout, the
softmax in log2 units (its constants for every attention kernel; the online step of the query-major
prefill kernel and the Hopper and Blackwell decode kernels) and the shape check of their public entry
points.

The LSE merge and the forced-block priority are MSA maths and live in :mod:`m3jax.msa.reference`,
which the kernels and their references import.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.pallas._backend import interpreting, plgpu, tcgen05_thread_sync


def check_dims(where: str, **arrays: tuple) -> dict[str, int]:
    """Check that arrays agree on named dimensions before a kernel runs: ``name=(array, "B T N H")``
    gives each axis of ``array`` a letter, and one letter must have one size across all arrays. A
    kernel does not check its operands' shapes (out-of-range TMA boxes read zeros or other rows), so
    a mismatch left to it gives wrong numbers or an interpreter crash instead of an error. Raises
    ValueError naming the entry point, the array and the dimension; returns the sizes by letter."""
    sizes: dict[str, tuple[int, str]] = {}
    for name, (x, spec) in arrays.items():
        letters = spec.split()
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != len(letters):
            raise ValueError(f"{where}: {name} must be [{', '.join(letters)}], got shape {shape}")
        for axis, (letter, size) in enumerate(zip(letters, shape)):
            seen = sizes.setdefault(letter, (size, name))
            if seen[0] != size:
                raise ValueError(f"{where}: {name} has {letter}={size} (dimension {axis} of {shape}) but {seen[1]} "
                                 f"has {letter}={seen[0]}")
    return {letter: size for letter, (size, _) in sizes.items()}


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


def tmem_handoff(wait: str) -> None:
    """After this warpgroup read TMEM ("ld": ``async_load_tmem``) or wrote it ("st": ``async_store_tmem``),
    before one thread issues a tcgen05 MMA that overwrites or reads those columns: every thread's
    loads or stores are done and ordered before the MMA, across threads, as the PTX ISA asks
    (``tcgen05.fence::before_thread_sync`` / ``after_thread_sync`` around the ``bar.sync``:
    :func:`m3jax.pallas._backend.tcgen05_thread_sync`). Replaces ``wait_load_tmem`` / ``commit_tmem``
    at such a hand-off. Interpret mode has no cross-thread TMEM ordering to model: there it is
    ``wait_load_tmem`` / ``commit_tmem``, which the interpreter simulates."""
    if interpreting():
        plgpu.wait_load_tmem() if wait == "ld" else plgpu.commit_tmem()
    else:
        tcgen05_thread_sync(wait)


def swizzle_transforms(minor: int, itemsize: int = 2) -> tuple:
    """SMEM tiling + swizzle for tiles whose rows hold ``minor`` elements of ``itemsize`` bytes: the
    widest swizzle (<= 128 B) the row allows, in 8-row tiles, as wgmma and TMA expect."""
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)  # find_swizzle takes the row in bits
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


# The attention kernels' softmax runs in log2 units: scores are scaled by LOG2E once (folded into
# 1/sqrt(H)), exponentials are exp2, and the LSE goes back to natural log by LN2.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def online_softmax_step(s: jax.Array, m_i: jax.Array, l_i: jax.Array):
    """One online-softmax step over masked scores ``s`` [rows, keys] (log2 units, -inf = masked), with
    the running row max ``m_i`` and sum ``l_i``: (m_new, alpha, p, l_new); the caller rescales its
    output accumulator by ``alpha``. A row with every key masked so far keeps m = -inf, alpha and p 0
    (not the NaN of -inf - -inf)."""
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
    return m_new, alpha, p, l_i * alpha + p.sum(axis=1)


def softmax_normalisers(m_i: jax.Array, l_i: jax.Array):
    """1 / l per row (0 for rows without a visible key) and the natural-log LSE (-inf for those)."""
    has = l_i > 0.0
    inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
    return inv, jnp.where(has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) * LN2, -jnp.inf)


def p_mma_parts(p: jax.Array, n_parts: int, dtype) -> tuple[jax.Array, ...]:
    """The fp32 probabilities P in the PV MMA's 16-bit type: two bf16 pieces for fp32 inputs (bf16x3
    with V's pieces), else one cast to ``dtype``."""
    return bf16_split_in_kernel(p) if n_parts == 2 else (p.astype(dtype),)
