"""Public entry points: load_pretrained, init_random, forward, save_pretrained."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
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
from m3jax.params import init_random as _init_params
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


_FALLBACK_WARNED: set[str] = set()


def resolve_attention_impl(impl: str, cfg=None, dtype="bfloat16") -> str:
    """The attention path a model of ``cfg`` in ``dtype`` runs.

    "auto" -> "pallas" on a GPU when the MSA kernels take the config (:func:`m3jax.msa.kernels.unsupported_reason`:
    shapes, and a kernel that failed its self-check there), else "reference" with one warning per reason;
    off the GPU always "reference" (the kernels' interpret mode is a test tool, not a fast path). Both
    paths compute the same model: exact in fp32 (the kernels split fp32 into bf16 pieces, XLA runs fp32
    dots at full precision, :func:`m3jax.model.matmul_precision`), and in bf16 they differ only by
    accumulation order (:mod:`m3jax.msa.compare`). "pallas" is checked the same way and refused with
    the reason."""
    if impl not in ("auto", "pallas"):
        return impl
    from m3jax.pallas._backend import on_gpu

    reason = None
    if cfg is not None and cfg.text.has_sparse_layers:
        from m3jax.msa.kernels import unsupported_reason

        reason = unsupported_reason(cfg.text, dtype)
    if impl == "pallas":
        if reason:
            raise UnsupportedConfigError(f"attention_impl='pallas' cannot run this config: {reason}")
        if not on_gpu():
            warnings.warn("attention_impl='pallas' off the GPU runs the kernels in Mosaic GPU's interpret mode: the "
                          "same numbers, orders of magnitude slower (a test tool; 'reference' is the CPU path)",
                          stacklevel=3)
        return impl
    if not on_gpu():
        return "reference"
    if reason:
        if reason not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(reason)
            warnings.warn(f"attention_impl='auto': the MSA kernels cannot run this config ({reason}); "
                          "running the jnp reference path", RuntimeWarning, stacklevel=3)
        return "reference"
    return "pallas"


def load_pretrained(path: str | Path, dtype: str = "bfloat16", attention_impl: str = "auto", progress: bool = True,
                    mesh=None, weights: str = "dequantize", allow_nonfinite: bool = False) -> M3Model:
    """Load an HF-layout MiniMax-M3 checkpoint directory (config.json + safetensors, BF16 or MXFP8).

    ``dtype="auto"`` runs in the checkpoint's own dtype (:func:`m3jax.checkpoint.checkpoint_dtype`).
    With ``mesh`` (``m3jax.sharding.make_mesh``) each device reads only its shard from the files.
    ``weights="mxfp8"`` keeps an MXFP8 checkpoint's quantised weights as fp8 values + E8M0 scales on the
    device (:class:`m3jax.layers.MXFP8Weight`; the MoE grouped GEMM reads them as they are, and so do the
    other matmuls at decode row counts, :func:`m3jax.moe.linear`; elsewhere they dequantise at use); ``"dequantize"`` (default) holds them in ``dtype``.

    A checkpoint holding NaN or infinite values is refused by name (:class:`m3jax.checkpoint.NonFiniteError`)
    unless ``allow_nonfinite=True``. A load that overlaps a save of the same folder reads it again
    (the save id in config.json changed while reading), and after a few such tries raises
    :class:`m3jax.checkpoint.CheckpointChanged`: the model returned is all of one save."""
    if dtype not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r}; choose 'auto', 'bfloat16' or 'float32'")
    for _ in range(_LOAD_TRIES):
        before = saved_id(path)
        try:
            model = _load(path, dtype, attention_impl, progress, mesh, weights, allow_nonfinite, before)
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


def _load(path, dtype, attention_impl, progress, mesh, weights, allow_nonfinite, save_id) -> M3Model:
    cfg = load_config(path)
    if dtype == "auto":
        dtype = checkpoint_dtype(path)
    cfg = cfg.replace(attention_impl=resolve_attention_impl(attention_impl, cfg, dtype))
    if mesh is not None:
        from m3jax.sharding import load_sharded

        return M3Model(cfg, load_sharded(path, cfg, mesh, dtype=dtype, progress=progress, weights=weights,
                                         allow_nonfinite=allow_nonfinite, save_id=save_id), mesh)
    params = load_params(path, cfg, dtype=dtype, progress=progress, weights=weights,
                         allow_nonfinite=allow_nonfinite, save_id=save_id)
    return M3Model(cfg, params)


def init_random(config: M3Config, seed: int = 0, dtype: str = "float32", mesh=None) -> M3Model:
    """Random weights for any config (tests, benchmarks, the tiny default); placed by the sharding
    rules on ``mesh`` when one is given."""
    if dtype_name(dtype) not in ("bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r}; choose 'bfloat16' or 'float32' (m3jax computes in those)")
    cfg = dataclasses.replace(config, attention_impl=resolve_attention_impl(config.attention_impl, config, dtype))
    if mesh is not None:
        from m3jax.sharding import shard_params

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
