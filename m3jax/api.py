"""Public entry points: load_pretrained, init_random, forward, save_pretrained."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.checkpoint import (
    CheckpointChanged,
    CheckpointError,
    checkpoint_dtype,
    dtype_name,
    load_params,
    save_checkpoint,
    saved_id,
)
from m3jax.config import M3Config, UnsupportedConfigError, load_config
from m3jax.model import check_input_ids, forward_jit
from m3jax.msa.layer import resolve_attention_impl
from m3jax.params import init_random as _init_params
from m3jax.sharding import load_sharded, shard_params
from m3jax.vision import check_grid


@dataclasses.dataclass
class M3Model:
    """A config and its parameter tree (see :mod:`m3jax.params` for the layout)."""

    config: M3Config
    params: dict
    # The jax.sharding.Mesh the params are placed on (m3jax.sharding), or None for one device.
    mesh: Any = None


@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array  # fp32 [B, T, vocab]
    # {layer: int32 [B, index_n_heads, T, topk]} for MSA layers, -1 padded; None unless asked for.
    block_indices: dict[int, jax.Array] | None = None


def load_pretrained(path: str | Path, dtype: str = "bfloat16", attention_impl: str = "auto", progress: bool = True,
                    mesh=None, weights: str = "dequantize", allow_nonfinite: bool = False,
                    config: M3Config | None = None) -> M3Model:
    """Load an HF-layout MiniMax-M3 checkpoint directory (config.json + safetensors, BF16 or MXFP8).

    ``dtype="auto"`` runs in the checkpoint's own dtype (:func:`m3jax.checkpoint.checkpoint_dtype`).
    With ``mesh`` (``m3jax.sharding.make_mesh``) each device reads only its shard from the files.
    ``weights="mxfp8"`` keeps an MXFP8 checkpoint's quantised weights as fp8 values + E8M0 scales on the
    device (:class:`m3jax.layers.MXFP8Weight`; the MoE grouped GEMM reads them as they are, and so do the
    other matmuls at decode row counts, :func:`m3jax.moe.linear`; elsewhere they dequantise at use); ``"dequantize"`` (default) holds them in ``dtype``.

    A checkpoint holding NaN or infinite values is refused by name (:class:`m3jax.checkpoint.NonFiniteError`)
    unless ``allow_nonfinite=True``. A load that overlaps a save of the same folder reads it again
    (the save id in config.json changed while reading), and after a few such tries raises
    :class:`m3jax.checkpoint.CheckpointChanged`: the model returned is all of one save.

    ``attention_impl`` is resolved here (:func:`m3jax.msa.layer.resolve_attention_impl`) into the
    model's config. A caller that built and resolved the config itself (the generate CLI: the
    checkpoint's config with its overrides) passes it as ``config`` instead: the model gets it as it
    is, nothing resolved again. The weights are read by the checkpoint's config.json either way."""
    if dtype not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r}; choose 'auto', 'bfloat16' or 'float32'")
    if config is not None and attention_impl != "auto":
        raise ValueError("pass attention_impl or a resolved config, not both (the config's attention_impl is used)")
    for _ in range(_LOAD_TRIES):
        before = saved_id(path)
        try:
            model = _load(path, dtype, attention_impl, config, progress, mesh, weights, allow_nonfinite, before)
        except (CheckpointError, UnsupportedConfigError, OSError):
            if saved_id_or_none(path) == before:
                raise  # the folder did not change under the load: the error is the checkpoint's own
            continue
        if saved_id_or_none(path) == before:
            return model
    raise CheckpointChanged(f"{path}: the checkpoint was replaced during each of {_LOAD_TRIES} tries to load it; "
                            "load it once the saves into it have finished")


_LOAD_TRIES = 3


def saved_id_or_none(path) -> str | None:
    """The folder's save id, or None when its config.json cannot be read (e.g. mid-swap)."""
    try:
        return saved_id(path)
    except (OSError, ValueError):
        return None


def _load(path, dtype, attention_impl, config, progress, mesh, weights, allow_nonfinite, save_id) -> M3Model:
    cfg = load_config(path)
    if dtype == "auto":
        dtype = checkpoint_dtype(path)
    cfg = cfg.replace(attention_impl=resolve_attention_impl(attention_impl, cfg, dtype) if config is None
                      else config.attention_impl)
    if mesh is not None:
        params = load_sharded(path, cfg, mesh, dtype=dtype, progress=progress, weights=weights,
                              allow_nonfinite=allow_nonfinite, save_id=save_id)
    else:
        params = load_params(path, cfg, dtype=dtype, progress=progress, weights=weights,
                             allow_nonfinite=allow_nonfinite, save_id=save_id)
    return M3Model(config or cfg, params, mesh)


def init_random(config: M3Config, seed: int = 0, dtype: str = "float32", mesh=None) -> M3Model:
    """Random weights for any config (tests, benchmarks, the tiny default); placed by the sharding
    rules on ``mesh`` when one is given."""
    if dtype_name(dtype) not in ("bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r}; choose 'bfloat16' or 'float32' (m3jax computes in those)")
    cfg = dataclasses.replace(config, attention_impl=resolve_attention_impl(config.attention_impl, config, dtype))
    if mesh is not None:
        return M3Model(cfg, shard_params(_init_params(cfg, seed, dtype=jnp.dtype(dtype)), cfg, mesh), mesh)
    return M3Model(cfg, _init_params(cfg, seed, dtype=jnp.dtype(dtype)))


def save_pretrained(model: M3Model, path: str | Path, **kwargs) -> Path:
    """Write the model as an HF checkpoint (official tensor names); see ``checkpoint.save_checkpoint``.
    A folder that already holds a checkpoint is refused unless ``overwrite=True``."""
    return save_checkpoint(model.params, model.config, path, **kwargs)


def _grid(grid_thw, what: str) -> tuple[tuple[int, int, int], ...]:
    g = np.asarray(grid_thw)
    if g.ndim != 2 or g.shape[1] != 3:
        raise ValueError(f"{what} must be [n, 3] (t, h, w), got shape {g.shape}")
    # A fractional grid would be truncated silently by int(): refuse values that are not whole numbers.
    if not (np.issubdtype(g.dtype, np.integer) or (np.issubdtype(g.dtype, np.floating) and np.all(g == np.round(g)))):
        raise ValueError(f"{what} must hold integers (patches per axis), got {g.tolist()}")
    return tuple(tuple(int(v) for v in row) for row in g)


def _media(model, input_ids, pixels, grid_thw, token_id, kind):
    """Validate one media input on the host; returns (pixels or None, static grid or None)."""
    n_placeholders = int((input_ids == token_id).sum())
    if pixels is None:
        if n_placeholders:
            raise ValueError(f"input_ids hold {n_placeholders} {kind} placeholder(s) (id {token_id}) but no {kind} pixels were given")
        return None, None
    if model.config.vision is None:
        raise UnsupportedConfigError(f"{kind} input given but the config has no vision_config")
    if grid_thw is None:
        raise ValueError(f"{kind} pixels given without their grid_thw")
    grid = _grid(grid_thw, f"{kind}_grid_thw")
    dtype = np.asarray(pixels).dtype if not hasattr(pixels, "dtype") else pixels.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        # uint8 pixels would skip the processor's rescale and normalisation: the tower would see 0..255.
        raise ValueError(f"{kind} pixel_values must be floats (the processor's normalised patches), got {dtype}")
    check_grid(tuple(np.shape(pixels)), grid, model.config.vision, kind)
    merge = model.config.vision.spatial_merge_size ** 2
    n_tokens = sum(t * h * w for t, h, w in grid) // merge
    if n_tokens != n_placeholders:
        raise ValueError(
            f"{kind} features give {n_tokens} tokens but input_ids hold {n_placeholders} placeholder(s) (id {token_id})"
        )
    return jnp.asarray(pixels, jnp.float32), grid


def forward(
    model: M3Model,
    input_ids,
    *,
    pixel_values=None,
    image_grid_thw=None,
    pixel_values_videos=None,
    video_grid_thw=None,
    return_block_indices: bool = False,
) -> ForwardOutput:
    """Full forward pass. input_ids: int [B, T] (a 1-D sequence is treated as B = 1).

    Media follow transformers' inputs: ``pixel_values`` [N, C*T*P*P] with ``image_grid_thw`` [n, 3], and
    ``pixel_values_videos`` with ``video_grid_thw`` (one row per attention segment).
    """
    cfg = model.config
    ids = check_input_ids(input_ids, cfg.text)
    pix, image_grid = _media(model, ids, pixel_values, image_grid_thw, cfg.image_token_id, "image")
    vid, video_grid = _media(model, ids, pixel_values_videos, video_grid_thw, cfg.video_token_id, "video")
    # Under the model's mesh, sharded params and the expert-parallel MoE are used (m3jax.sharding).
    with jax.set_mesh(model.mesh) if model.mesh is not None else contextlib.nullcontext():
        logits, blocks = forward_jit(model.params, jnp.asarray(ids, jnp.int32), pix, vid, cfg, image_grid, video_grid)
    return ForwardOutput(logits, blocks if return_block_indices else None)
