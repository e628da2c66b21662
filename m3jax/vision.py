"""Vision tower, projector and 2x2 patch merger of MiniMax-M3 (docs/ARCHITECTURE.md §3).

ViT: Conv3d patch embed as a matmul on flat [N, C*Tp*P*P] patches, pre-LN, 32 CLIP pre-LN encoder
layers with bidirectional attention inside each segment and 3-D axial RoPE, no post-LN.
Each row of ``grid_thw`` is one attention segment (transformers' convention: its video processor
emits one row per chunk of at most ``vision_segment_max_frames`` temporal patches, so long videos
arrive already split and the temporal position restarts at 0 in each row).
Projector (per patch): Linear(Dv->Pj) GELU Linear(Pj->D); merger (per 2x2 window of 4 consecutive
patches): Linear(4D->Pj) GELU Linear(Pj->D).

``grid_thw`` is host data (it fixes shapes), passed as a tuple of (t, h, w) tuples.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from m3jax.config import M3Config, VisionConfig
from m3jax.layers import apply_rope, gelu, layer_norm, matmul_precision
from m3jax.msa import HIGHEST

Grid = tuple[tuple[int, int, int], ...]


def vision_positions(grid_thw: Grid, merge: int) -> np.ndarray:
    """(t, h, w) patch coordinates [N, 3] in the processor's patch order: (t, h//m, w//m, h%m, w%m)."""
    rows = []
    for t, h, w in grid_thw:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        ww = ww.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        tt = np.repeat(np.arange(t), h * w)
        rows.append(np.stack([tt, np.tile(hh, t), np.tile(ww, t)], axis=-1))
    return np.concatenate(rows, axis=0)


def vision_rope_angles(positions: jax.Array, cfg: VisionConfig) -> jax.Array:
    """Angles [N, 3 * a/2] = [t * f | h * f | w * f], f = theta^(-(0,2,..,a-2)/a), a = axis_rotary_dim."""
    a = cfg.axis_rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, a, 2, dtype=jnp.float32) / a))
    return (positions.astype(jnp.float32)[..., None] * inv_freq).reshape(positions.shape[0], -1)


def check_grid(pixel_values_shape: tuple[int, ...], grid_thw: Grid, cfg: VisionConfig, what: str) -> None:
    """Clear errors for inputs the tower cannot take."""
    if len(pixel_values_shape) != 2 or pixel_values_shape[1] != cfg.patch_dim:
        raise ValueError(
            f"{what}: pixel values must be [num_patches, {cfg.patch_dim}] "
            f"(C*T*P*P = {cfg.num_channels}*{cfg.temporal_patch_size}*{cfg.patch_size}^2), got {pixel_values_shape}"
        )
    m = cfg.spatial_merge_size
    for row in grid_thw:
        t, h, w = row
        if min(t, h, w) < 1 or h % m or w % m:
            raise ValueError(f"{what}: grid row {row} must be positive with h and w multiples of {m}")
    n = sum(t * h * w for t, h, w in grid_thw)
    if n != pixel_values_shape[0]:
        raise ValueError(f"{what}: grid_thw covers {n} patches but pixel values have {pixel_values_shape[0]} rows")


def _segment_attention(q, k, v, grid_thw: Grid):
    """Bidirectional attention inside each segment without a cross-segment mask.

    Segments of equal length are stacked and attended as a batch. q, k, v: [N, heads, hd].
    """
    lengths = [t * h * w for t, h, w in grid_thw]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = jnp.zeros(q.shape, jnp.float32)
    scale = q.shape[-1] ** -0.5
    # On the GPU with 16-bit activations, cuDNN's fused attention runs each stack of segments.
    fused = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    for length in sorted(set(lengths)):
        idx = np.concatenate([np.arange(s, s + length) for s, l in zip(starts, lengths) if l == length])
        qs, ks, vs = (x[idx].reshape(-1, length, *x.shape[1:]) for x in (q, k, v))
        if fused:
            o = jax.nn.dot_product_attention(qs, ks, vs, implementation="cudnn").astype(jnp.float32)
        else:
            qs, ks, vs = (x.astype(jnp.float32) for x in (qs, ks, vs))
            logits = jnp.einsum("snhd,smhd->shnm", qs, ks, precision=HIGHEST) * scale
            o = jnp.einsum("shnm,smhd->snhd", jax.nn.softmax(logits, axis=-1), vs, precision=HIGHEST)
        out = out.at[idx].set(o.reshape(-1, *q.shape[1:]))
    return out.astype(q.dtype)


def vision_tower(pixel_values: jax.Array, grid_thw: Grid, p: dict, cfg: VisionConfig) -> jax.Array:
    """ViT forward. pixel_values: [N, C*Tp*P*P] -> last hidden state [N, Dv] (no post-LN)."""
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    x = jnp.dot(pixel_values.astype(p["patch_embed"].dtype), p["patch_embed"], precision=HIGHEST)
    dtype = p["pre_ln"]["scale"].dtype
    x = layer_norm(x.astype(dtype), p["pre_ln"], cfg.layer_norm_eps)
    angles = vision_rope_angles(jnp.asarray(vision_positions(grid_thw, cfg.spatial_merge_size)), cfg)
    n = x.shape[0]
    for lp in p["layers"]:
        y = layer_norm(x, lp["ln1"], cfg.layer_norm_eps)
        q = (y @ lp["wq"] + lp["bq"]).reshape(n, heads, hd)
        k = (y @ lp["wk"] + lp["bk"]).reshape(n, heads, hd)
        v = (y @ lp["wv"] + lp["bv"]).reshape(n, heads, hd)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        a = _segment_attention(q, k, v, grid_thw).reshape(n, -1)
        x = x + (a @ lp["wo"] + lp["bo"])
        y = layer_norm(x, lp["ln2"], cfg.layer_norm_eps)
        x = x + (gelu(y @ lp["fc1"] + lp["b1"]) @ lp["fc2"] + lp["b2"])
    return x


def project_and_merge(features: jax.Array, projector: dict, merger: dict, cfg: M3Config) -> jax.Array:
    """[N, Dv] vision features -> [N / m^2, D] text-space tokens (projector per patch, then merge)."""
    x = gelu(features @ projector["w1"] + projector["b1"]) @ projector["w2"] + projector["b2"]
    x = x.reshape(x.shape[0] // cfg.vision.spatial_merge_size**2, -1)
    return gelu(x @ merger["w1"] + merger["b1"]) @ merger["w2"] + merger["b2"]


def encode_media(pixel_values: jax.Array, grid_thw: Grid, params: dict, cfg: M3Config) -> tuple[jax.Array, jax.Array]:
    """Vision tower + projector + merger: returns (tower hidden [N, Dv], tokens [N/4, D])."""
    with matmul_precision(params["projector"]["w1"].dtype):  # fp32 weights: fp32 matmuls on the GPU too
        hidden = vision_tower(pixel_values, grid_thw, params["vision"], cfg.vision)
        return hidden, project_and_merge(hidden, params["projector"], params["merger"], cfg)
