"""Small building blocks shared by the text and vision towers: norms, RoPE, activations, and the
MXFP8 weight type that ``load_pretrained(..., weights="mxfp8")`` keeps on the device."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

MXFP8_BLOCK = 32  # inputs per E8M0 scale (the OCP MX block of the released MXFP8 checkpoint)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP8Weight:
    """A matmul weight kept as MXFP8: ``values`` float8_e4m3fn in the layout of the weight it replaces
    (``[in..., out...]``, experts first), ``scales`` uint8 E8M0 exponents (W = values * 2^(scales - 127))
    of that shape with the last input axis divided by :data:`MXFP8_BLOCK` (e.g. wo ``[N, H, D]`` ->
    ``[N, H / 32, D]``, expert gate ``[E, D, Fe]`` -> ``[E, D / 32, Fe]``). A pytree of its two leaves, so
    jit, device_put, shardings and ``shard_map`` specs treat it as one node (the param specs hold an
    ``MXFP8Weight`` of two ``ParamSpec`` s where the model holds one of two arrays)."""

    values: Any
    scales: Any

    @property
    def group_axis(self) -> int:
        """The input axis the scales group (the one axis where the two shapes differ)."""
        v, s = tuple(self.values.shape), tuple(self.scales.shape)
        differ = [i for i, (a, b) in enumerate(zip(v, s)) if a != b]
        if len(v) != len(s) or len(differ) != 1 or s[differ[0]] < 1 or v[differ[0]] % s[differ[0]]:
            raise ValueError(f"MXFP8Weight: scales {s} must be the values' shape {v} with one input axis divided "
                             f"by the scale group ({MXFP8_BLOCK} inputs in M3's checkpoints)")
        return differ[0]


def dequantize_mxfp8(values, scales, dtype=jnp.float32, axis: int = -2) -> jax.Array:
    """values float8_e4m3fn [..., K, ...] * 2^(scales uint8 [..., K / group, ...] - 127), in ``dtype``: one
    E8M0 exponent per ``group`` consecutive entries of ``axis`` (the input axis; default: [..., K, N])."""
    axis = axis % values.ndim
    k, groups = values.shape[axis], scales.shape[axis]
    scale = jnp.ldexp(jnp.float32(1.0), scales.astype(jnp.int32) - 127)
    w = values.astype(jnp.float32).reshape(*values.shape[:axis], groups, k // groups, *values.shape[axis + 1:])
    return (w * jnp.expand_dims(scale, axis + 1)).reshape(values.shape).astype(dtype)


def dequantize(w, dtype):
    """``w`` as a ``dtype`` array: an :class:`MXFP8Weight` dequantised, any other array as it is.

    Called inside jit (by :func:`m3jax.moe.linear` where it does not take the MXFP8 kernel, and by
    :func:`dequantize_tree`), so XLA sees convert(f8 -> f32) x broadcast(2^(e - 127)) -> convert feeding
    the dot. XLA:GPU writes the dequantised weight to a temporary that the dot reads (convert fusions
    before the GEMM, ``benchmarks/RESULTS.md#mxfp8-xla-dequantise``; the resident weights stay fp8, the
    temporary lives for one layer). The routed experts do not come here: their grouped GEMM reads the fp8 tiles
    itself (:mod:`m3jax.pallas.grouped_matmul`). Values x power-of-two scales are exact in bf16, so the result
    equals the bf16 weight a dequantise-on-load model holds.
    """
    if not isinstance(w, MXFP8Weight):
        return w
    return dequantize_mxfp8(w.values, w.scales, dtype, axis=w.group_axis)


def dequantize_tree(tree, dtype, keep=lambda path: False):
    """Every :class:`MXFP8Weight` of ``tree`` dequantised to ``dtype`` (:func:`dequantize`), except those
    whose key path ``keep(path)`` keeps (the MoE experts, for the grouped GEMM)."""
    def one(path, x):
        return x if keep(path) else dequantize(x, dtype)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, MXFP8Weight))


def matmul_precision(dtype):
    """The precision scope of the model's matmuls for weights of ``dtype``: the precision contract.

    ``dtype="float32"`` means fp32 arithmetic on every backend. XLA runs fp32 dots as TF32 (10-bit
    mantissa) on NVIDIA GPUs by default, far outside the fp32 tolerance against the oracle and enough to
    flip MSA selections (docs/MSA.md §1.6); so an fp32 model traces its matmuls under
    ``jax.default_matmul_precision("highest")`` (full fp32, on CPU a no-op). bf16 keeps DEFAULT: bf16
    tensor cores, the fast setting. The scope is entered where a model computation starts
    (:func:`m3jax.model.decoder_layer`, :func:`m3jax.model.lm_head`, :func:`m3jax.vision.encode_media`),
    so every einsum written inside them follows it without a ``precision=`` of its own. The Pallas
    kernels do not read it: they split fp32 operands into bf16 pieces themselves (pallas/_common).
    """
    return jax.default_matmul_precision("highest") if jnp.dtype(dtype) == jnp.float32 else contextlib.nullcontext()


def dot_precision(dtype):
    """``precision=`` for a fallback matmul of ``dtype`` operands, on top of :func:`matmul_precision`'s scope:
    ``HIGHEST`` for fp32, None (the scope's default) otherwise. The MoE's ``ragged_dot`` and the dense
    MLP's dots pass it themselves, so fp32 stays fp32 wherever they are traced, inside the model's scope
    or not (a benchmark, the expert-parallel shard_map, a caller of :mod:`m3jax.moe`)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma RMSNorm over the last axis: normalise in fp32, scale by (1 + w), cast back.

    The checkpoint stores the offset ``w`` (initialised to zero), not the scale.
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def layer_norm(x: jax.Array, p: dict, eps: float) -> jax.Array:
    """LayerNorm with scale and bias (vision tower), statistics in fp32."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def rope_angles(positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Angles [..., rotary_dim // 2] = pos * theta^(-2i / rotary_dim) (fp32)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x: jax.Array, angles: jax.Array) -> jax.Array:
    """NeoX (rotate-half) RoPE on the first ``2 * angles.shape[-1]`` channels of ``x``; the rest pass.

    x: [..., S, heads, dim]; angles: [..., S, r/2] (broadcast over heads). Pairs are (i, i + r/2).
    """
    half = angles.shape[-1]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


def swiglu_oai(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss style SwiGLU with clamps: min(gate, limit) * sigmoid(alpha * gate) * (clip(up) + 1)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1.0)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, as torch's nn.functional.gelu default."""
    return jax.nn.gelu(x, approximate=False)
