"""Hugging Face checkpoint <-> m3jax parameter tree.

Official tensor names (docs/ARCHITECTURE.md §4), e.g.::

    language_model.model.layers.{i}.self_attn.q_proj.weight                 [N*H, D]  -> text.layers[i].attn.wq [D, N, H]
    language_model.model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  [Fe, D]   -> stacked into moe.gate [E, D, Fe]
    vision_tower.vision_model.embeddings.patch_embedding.weight             [Dv,C,T,P,P] -> vision.patch_embed [C*T*P*P, Dv]
    patch_merge_mlp.linear_1.weight                                         [Pj, 4D]  -> merger.w1 [4D, Pj]

Loading is lazy (memory-mapped safetensors, one tensor at a time; per-expert tensors written into
one preallocated stack), so host memory peaks near the largest stacked tensor. MXFP8 weights
(float8_e4m3fn + uint8 E8M0 ``weight_scale_inv`` per 32 inputs) are dequantised on load, or with
``weights="mxfp8"`` kept as they are: fp8 values and uint8 scales re-laid out like the weight they
stand for (:class:`m3jax.layers.MXFP8Weight`, the specs of ``param_specs(cfg, "mxfp8")``). Every
problem names the tensor: missing, unexpected, wrong shape, wrong dtype, truncated file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from m3jax.config import M3Config, UnsupportedConfigError, config_to_hf, read_config_json
from m3jax.layers import MXFP8_BLOCK, MXFP8Weight, dequantize
from m3jax.params import ParamSpec, param_specs
from m3jax.atomic import folder_lock, new_save_id, open_regular, staging_folder, swap_in
from m3jax.safetensors_io import CheckpointError, SafetensorsFile, write_safetensors

# The key under which every file of an m3jax save records the save's id (config.json, the index's
# metadata, each safetensors file's __metadata__): a reader checks that all it read is of one save.
SAVE_ID_KEY = "m3jax_save_id"


class CheckpointChanged(CheckpointError):
    """The files of a checkpoint come from different saves: it was replaced while being read."""


class NonFiniteError(CheckpointError):
    """A checkpoint holds NaN or infinite values; the message names the tensors."""


# Tensors transformers also skips on load: MTP heads the base model does not use.
IGNORED = re.compile(r"(^|\.)mtp\.")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter leaf and the checkpoint tensor(s) it comes from.

    kind: "copy" (same layout), "linear" (torch [out, in] -> [in..., out...], ``n_in`` leading dims of
    the leaf form ``in``), "experts" (one linear per expert, stacked on axis 0), "patch" (Conv3d weight
    flattened to [C*T*P*P, Dv]).
    """

    path: tuple
    names: tuple[str, ...]
    kind: str
    spec: ParamSpec | MXFP8Weight  # MXFP8Weight of two ParamSpecs: kept MXFP8 (weights="mxfp8")
    n_in: int = 1
    patch_shape: tuple[int, ...] = ()  # Conv3d weight shape [Dv, C, T, P, P] for kind "patch"

    @property
    def mxfp8(self) -> bool:
        return isinstance(self.spec, MXFP8Weight)

    @property
    def shape(self) -> tuple[int, ...]:
        """The leaf's shape (an MXFP8 leaf's values')."""
        return self.spec.values.shape if self.mxfp8 else self.spec.shape

    def hf_shape(self) -> tuple[int, ...]:
        """Shape of each checkpoint tensor (torch layout)."""
        s = self.shape
        if self.kind == "copy":
            return s
        if self.kind == "linear":
            return (math.prod(s[self.n_in :]), math.prod(s[: self.n_in]))
        if self.kind == "experts":
            return (s[2], s[1])
        return self.patch_shape


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def tensor_plan(cfg: M3Config, weights: str = "dequantize") -> list[Entry]:
    """Every parameter leaf with its official checkpoint name(s), in a stable order."""
    specs = param_specs(cfg, weights)
    out: list[Entry] = []

    def add(path, names, kind="linear", n_in=1, patch_shape=()):
        names = (names,) if isinstance(names, str) else tuple(names)
        out.append(Entry(tuple(path), names, kind, _get(specs, path), n_in, patch_shape))

    t = cfg.text
    lm = "language_model.model."
    add(("text", "embed"), lm + "embed_tokens.weight", "copy")
    add(("text", "lm_head"), "language_model.lm_head.weight")
    add(("text", "final_norm"), lm + "norm.weight", "copy")
    for i in range(t.num_hidden_layers):
        L = ("text", "layers", i)
        pre = f"{lm}layers.{i}."
        add(L + ("input_norm",), pre + "input_layernorm.weight", "copy")
        add(L + ("post_attn_norm",), pre + "post_attention_layernorm.weight", "copy")
        add(L + ("attn", "wq"), pre + "self_attn.q_proj.weight")
        add(L + ("attn", "wk"), pre + "self_attn.k_proj.weight")
        add(L + ("attn", "wv"), pre + "self_attn.v_proj.weight")
        add(L + ("attn", "wo"), pre + "self_attn.o_proj.weight", n_in=2)
        add(L + ("attn", "q_norm"), pre + "self_attn.q_norm.weight", "copy")
        add(L + ("attn", "k_norm"), pre + "self_attn.k_norm.weight", "copy")
        if t.is_sparse_attention(i):
            add(L + ("index", "wq"), pre + "self_attn.index_q_proj.weight")
            add(L + ("index", "wk"), pre + "self_attn.index_k_proj.weight")
            add(L + ("index", "q_norm"), pre + "self_attn.index_q_norm.weight", "copy")
            add(L + ("index", "k_norm"), pre + "self_attn.index_k_norm.weight", "copy")
        if t.is_moe(i):
            moe = pre + "block_sparse_moe."
            add(L + ("moe", "router"), moe + "gate.weight")
            add(L + ("moe", "router_bias"), moe + "e_score_correction_bias", "copy")
            for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                names = [f"{moe}experts.{e}.{theirs}.weight" for e in range(t.num_local_experts)]
                add(L + ("moe", ours), names, "experts")
            for ours in ("gate", "up", "down"):
                add(L + ("moe", "shared", ours), f"{moe}shared_experts.{ours}_proj.weight")
        else:
            for ours in ("gate", "up", "down"):
                add(L + ("mlp", ours), f"{pre}mlp.{ours}_proj.weight")

    if cfg.vision is not None:
        vt = "vision_tower.vision_model."
        v = cfg.vision
        conv = (v.hidden_size, v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        add(("vision", "patch_embed"), vt + "embeddings.patch_embedding.weight", "patch", patch_shape=conv)
        add(("vision", "pre_ln", "scale"), vt + "pre_layrnorm.weight", "copy")
        add(("vision", "pre_ln", "bias"), vt + "pre_layrnorm.bias", "copy")
        for j in range(cfg.vision.num_hidden_layers):
            V = ("vision", "layers", j)
            pre = f"{vt}encoder.layers.{j}."
            for ln in ("1", "2"):
                add(V + (f"ln{ln}", "scale"), f"{pre}layer_norm{ln}.weight", "copy")
                add(V + (f"ln{ln}", "bias"), f"{pre}layer_norm{ln}.bias", "copy")
            for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out")):
                add(V + (f"w{ours}",), f"{pre}self_attn.{theirs}_proj.weight")
                add(V + (f"b{ours}",), f"{pre}self_attn.{theirs}_proj.bias", "copy")
            add(V + ("fc1",), pre + "mlp.fc1.weight")
            add(V + ("b1",), pre + "mlp.fc1.bias", "copy")
            add(V + ("fc2",), pre + "mlp.fc2.weight")
            add(V + ("b2",), pre + "mlp.fc2.bias", "copy")
        for ours, theirs in (("projector", "multi_modal_projector"), ("merger", "patch_merge_mlp")):
            for n in ("1", "2"):
                add((ours, f"w{n}"), f"{theirs}.linear_{n}.weight")
                add((ours, f"b{n}"), f"{theirs}.linear_{n}.bias", "copy")
    return out


# --------------------------------------------------------------------------------------------------
# MXFP8 (float8_e4m3fn values, one E8M0 exponent per 32 inputs of a row)


def dequantize_mxfp8(w: np.ndarray, scale_inv: np.ndarray, name: str = "") -> np.ndarray:
    """W[o, i] = fp8[o, i] * 2^(scale_inv[o, i // 32] - 127), in fp32."""
    out_dim, in_dim = w.shape
    if scale_inv.shape != (out_dim, -(-in_dim // MXFP8_BLOCK)):
        raise CheckpointError(
            f"tensor {name}_scale_inv has shape {scale_inv.shape}, expected {(out_dim, -(-in_dim // MXFP8_BLOCK))}"
        )
    if scale_inv.dtype != np.uint8:
        raise CheckpointError(f"tensor {name}_scale_inv has dtype {scale_inv.dtype}, expected uint8 (E8M0)")
    scale = np.ldexp(np.float32(1.0), scale_inv.astype(np.int32) - 127).astype(np.float32)
    return w.astype(np.float32) * np.repeat(scale, MXFP8_BLOCK, axis=1)[:, :in_dim]


def quantize_mxfp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp32 [out, in] -> (float8_e4m3fn [out, in], uint8 exponents [out, in/32]); E4M3 max is 448."""
    out_dim, in_dim = w.shape
    if in_dim % MXFP8_BLOCK:
        raise ValueError(f"MXFP8 needs the input dim to be a multiple of {MXFP8_BLOCK}, got {in_dim}")
    blocks = w.astype(np.float32).reshape(out_dim, in_dim // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 448.0)), -127)
    e = np.clip(e, -127, 127).astype(np.int32)
    q = (blocks / np.ldexp(np.float32(1.0), e)[..., None]).reshape(out_dim, in_dim)
    return q.astype(ml_dtypes.float8_e4m3fn), (e + 127).astype(np.uint8)


# Weights the released MXFP8 checkpoint quantizes: attention, index branch, dense MLP, experts.
_MXFP8_QUANTIZED = re.compile(
    r"\.(self_attn\.(q|k|v|o|index_q|index_k)_proj|mlp\.(gate|up|down)_proj|"
    r"block_sparse_moe\.(shared_experts\.(gate|up|down)_proj|experts\.\d+\.w[123]))\.weight$"
)


def is_mxfp8_quantized(name: str) -> bool:
    return name.startswith("language_model.") and bool(_MXFP8_QUANTIZED.search(name))


# --------------------------------------------------------------------------------------------------
# Reading


class CheckpointReader:
    """Name -> tensor over a directory of safetensors shards (index.json, one file, or a glob)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                with open_regular(index, "a shard index") as f:
                    contents = json.loads(f.read())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index}: corrupt shard index, not a JSON file ({e})") from None
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            # Shards are files of this folder, as the loader without an index reads them.
            if not (isinstance(weight_map, dict) and all(
                    isinstance(f, str) and f.endswith(".safetensors") and Path(f).name == f
                    for f in weight_map.values())):
                raise CheckpointError(
                    f"{index}: corrupt shard index: needs a \"weight_map\" object mapping each tensor name to the "
                    "name of a .safetensors file in the folder"
                )
            files = sorted(set(weight_map.values()))
            if (self.directory / "model.safetensors").exists() and "model.safetensors" not in files:
                # Two checkpoints in one folder (transformers would load the single file, we the index).
                raise CheckpointError(
                    f"{self.directory}: holds model.safetensors and a model.safetensors.index.json that does "
                    "not list it: two checkpoints in one folder; remove the stale one"
                )
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory}: no model.safetensors.index.json and no *.safetensors files")
            weight_map = {}
        self.files: dict[str, SafetensorsFile] = {}
        for fname in files:
            path = self.directory / fname
            if not path.exists():
                raise CheckpointError(f"{index}: lists shard {fname} which does not exist")
            self.files[fname] = SafetensorsFile(path)
        self.location: dict[str, SafetensorsFile] = {}
        for fname, f in self.files.items():
            for name in f.keys():
                if name in self.location and not weight_map:
                    # Without an index nothing says which copy is meant; taking one would be a guess.
                    raise CheckpointError(
                        f"{self.directory}: tensor {name!r} is in both {self.location[name].path.name} and {fname}; "
                        "a folder without model.safetensors.index.json must hold each tensor once")
                self.location.setdefault(name, f)
        ids = {f.metadata.get(SAVE_ID_KEY) for f in self.files.values()}
        if weight_map:
            meta = contents.get("metadata")
            ids.add(meta.get(SAVE_ID_KEY) if isinstance(meta, dict) else None)
        if len(ids) > 1:
            raise CheckpointChanged(
                f"{self.directory}: its safetensors files come from different saves ({sorted(map(str, ids))}); "
                "another save replaced some of them, or a save was mixed with another: save the checkpoint again")
        # The save that wrote these files (None for checkpoints not written by m3jax).
        self.save_id: str | None = ids.pop() if ids else None
        for name, fname in weight_map.items():
            if name not in self.files[fname].entries:
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to {fname} but that file does not hold it")
            self.location[name] = self.files[fname]

    def names(self) -> set[str]:
        return set(self.location)

    def has(self, name: str) -> bool:
        return name in self.location

    def read(self, name: str) -> np.ndarray:
        if name not in self.location:
            raise CheckpointError(f"{self.directory}: missing tensor {name!r}")
        return self.location[name].get(name)

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``: every error about a tensor names it."""
        return self.location[name].path

    def read_checked(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The stored tensor (a memmap view) after checking its shape and that it is a float or MXFP8 one."""
        a = self.read(name)
        if tuple(a.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        if a.dtype == ml_dtypes.float8_e4m3fn:
            if not self.has(name + "_scale_inv"):
                raise CheckpointError(
                    f"{self.file_of(name)}: tensor {name!r} is float8_e4m3fn but {name + '_scale_inv'!r} is missing")
        elif not np.issubdtype(a.dtype, np.floating) and a.dtype != ml_dtypes.bfloat16:
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} has dtype {a.dtype}, expected a floating-point dtype")
        return a

    def dequantize(self, name: str, w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
        try:
            return dequantize_mxfp8(w, scale_inv, name)
        except CheckpointError as e:
            raise CheckpointError(f"{self.file_of(name + '_scale_inv')}: {e}") from None

    def read_dequantized(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, list[str]]:
        """fp32 (or stored float) tensor with its shape checked; returns (array, names consumed)."""
        a = self.read_checked(name, shape)
        if a.dtype == ml_dtypes.float8_e4m3fn:
            scale_name = name + "_scale_inv"
            return self.dequantize(name, a, self.read(scale_name)), [name, scale_name]
        return a, [name]


def _read_mxfp8(reader: CheckpointReader, name: str, hf_shape) -> tuple[np.ndarray, np.ndarray]:
    """The stored fp8 values [out, in] and uint8 scales [out, in / 32] of one weight, as memory maps."""
    a = reader.read_checked(name, hf_shape)
    if a.dtype != ml_dtypes.float8_e4m3fn:
        raise CheckpointError(
            f"{reader.file_of(name)}: tensor {name!r} is stored as {a.dtype}, not MXFP8; weights='mxfp8' keeps an "
            "MXFP8 checkpoint's weights as they are (load this one with weights='dequantize')")
    scale_name = name + "_scale_inv"
    scale = reader.read(scale_name)
    want = (hf_shape[0], hf_shape[1] // MXFP8_BLOCK)
    if tuple(scale.shape) != want or scale.dtype != np.uint8:
        raise CheckpointError(f"{reader.file_of(scale_name)}: tensor {scale_name!r} is {scale.dtype} "
                              f"{tuple(scale.shape)}, expected uint8 (E8M0) {want}")
    return a, scale


def require_mxfp8_storage(reader: CheckpointReader, plan: list[Entry]) -> None:
    """Refuse ``weights="mxfp8"`` on a checkpoint whose weights are not stored as MXFP8 before anything
    is loaded: every MXFP8 entry's first tensor and its scales are checked from the memory maps (headers
    only, no data read), so the error names the file and tensor at once instead of midway through a load."""
    for e in plan:
        if e.mxfp8:
            _read_mxfp8(reader, e.names[0], e.hf_shape())


def _mxfp8_leaf(reader: CheckpointReader, e: Entry, index: tuple | None = None,
                parts: tuple[str, ...] = ("values", "scales")) -> tuple[dict[str, np.ndarray], list[str]]:
    """An MXFP8 entry's ``parts`` ("values", "scales") in our layout, read without dequantising: the
    slice ``index`` of the values' shape (sharded loading; the scales' slice covers the same 32-input
    blocks). Returns ({part: array}, checkpoint names read)."""
    specs = e.spec
    v_index = _full_index(specs.values.shape, index)
    idx = {"values": v_index, "scales": _scale_index(specs, v_index)}
    shape = {"values": specs.values.shape, "scales": specs.scales.shape}
    suffix = {"values": "", "scales": "_scale_inv"}
    if e.kind == "experts":
        lo, hi, step = v_index[0].indices(specs.values.shape[0])
        mats: dict[str, list] = {p: [] for p in parts}
        used = []
        for i in range(lo, hi, step):
            stored = dict(zip(("values", "scales"), _read_mxfp8(reader, e.names[i], e.hf_shape())))
            for p in parts:
                mats[p].append(np.asarray(stored[p].T[idx[p][1:]]))
                used.append(e.names[i] + suffix[p])
        dtypes = {"values": ml_dtypes.float8_e4m3fn, "scales": np.uint8}
        return {p: _stack(mats[p], shape[p], idx[p], dtypes[p]) for p in parts}, used
    name = e.names[0]
    stored = dict(zip(("values", "scales"), _read_mxfp8(reader, name, e.hf_shape())))
    out = {p: _linear_slice(lambda r, c, a=stored[p]: np.asarray(a[r[0]:r[1], c[0]:c[1]]), shape[p], e.n_in, idx[p])
           for p in parts}
    return out, [name + suffix[p] for p in parts]


def _full_index(shape, index) -> tuple:
    index = tuple(slice(None) for _ in shape) if index is None else tuple(index)
    return index + tuple(slice(None) for _ in range(len(shape) - len(index)))


def _scale_index(specs: MXFP8Weight, v_index: tuple) -> tuple:
    """The slice of an MXFP8 leaf's scales that goes with slice ``v_index`` of its values: the grouped
    axis' bounds / 32 (a shard boundary inside a 32-input block is refused by the sharding rules)."""
    ax = specs.group_axis
    lo, hi, step = v_index[ax].indices(specs.values.shape[ax])
    if step != 1 or lo % MXFP8_BLOCK or hi % MXFP8_BLOCK:
        raise CheckpointError(f"a slice {lo}:{hi}:{step} of an MXFP8 weight's input axis does not cover whole "
                              f"{MXFP8_BLOCK}-input blocks")
    return v_index[:ax] + (slice(lo // MXFP8_BLOCK, hi // MXFP8_BLOCK),) + v_index[ax + 1:]


def _stack(mats, shape, index, dtype) -> np.ndarray:
    return np.stack(mats) if mats else np.empty((0,) + np.empty(shape[1:], np.uint8)[index[1:]].shape, dtype)


def _convert(reader: CheckpointReader, e: Entry, out_dtype) -> tuple[np.ndarray | MXFP8Weight, list[str]]:
    """Read and re-layout one entry into a numpy array of the leaf's shape and ``out_dtype`` (an MXFP8
    entry: its values and scales as stored)."""
    if e.mxfp8:
        leaf, used = _mxfp8_leaf(reader, e)
        return MXFP8Weight(**leaf), used
    if e.kind == "experts":
        stacked = np.empty(e.spec.shape, dtype=out_dtype)
        used = []
        for idx, name in enumerate(e.names):
            a, u = reader.read_dequantized(name, e.hf_shape())
            stacked[idx] = a.T.astype(out_dtype)
            used += u
        return stacked, used
    name = e.names[0]
    if e.kind == "patch":
        a, used = reader.read_dequantized(name, e.hf_shape())
        return a.reshape(a.shape[0], -1).T.astype(out_dtype), used
    a, used = reader.read_dequantized(name, e.hf_shape())
    if e.kind == "linear":
        a = a.T
    return a.reshape(e.spec.shape).astype(out_dtype), used


def nonfinite_names(e: Entry, arr, index: tuple | None = None) -> list[str]:
    """The checkpoint names of entry ``e`` whose values in ``arr`` (the leaf in our layout, or its
    slice ``index``) hold a NaN or an infinity: the experts by number, other leaves by their tensor."""
    values = np.asarray(arr.values if isinstance(arr, MXFP8Weight) else arr)
    if e.kind == "experts":
        first = 0 if index is None or not index else index[0].indices(len(e.names))[0]
        ok = np.isfinite(values).reshape(values.shape[0], -1).all(axis=1)
        return [e.names[first + i] for i in np.flatnonzero(~ok)]
    return [] if np.isfinite(values).all() else [e.names[0]]


def refuse_nonfinite(directory, bad: list[str]) -> None:
    """Raise :class:`NonFiniteError` naming the tensors in ``bad`` (nothing when it is empty)."""
    if bad:
        raise NonFiniteError(
            f"{directory}: {len(bad)} tensor(s) hold NaN or infinite values: {sorted(set(bad))[:8]}; the model "
            "would compute NaN (a corrupt or diverged checkpoint). allow_nonfinite=True "
            "(--allow-nonfinite-weights) loads it anyway, to study it")


def iter_checkpoint_arrays(
    directory: str | Path, cfg: M3Config, dtype="bfloat16", progress: bool = True, weights: str = "dequantize",
    *, allow_nonfinite: bool = False, save_id: str | None | bool = False,
) -> Iterator[tuple[Entry, np.ndarray | MXFP8Weight]]:
    """Yield (entry, numpy array in our layout) one leaf at a time; verifies nothing is left unused.
    ``weights="mxfp8"``: the MXFP8 leaves come as :class:`MXFP8Weight` of their stored values and scales.

    Every leaf is checked for NaN and infinities; :class:`NonFiniteError` after the last leaf names
    them all, unless ``allow_nonfinite``. ``save_id`` (a str, or None for a checkpoint not saved by
    m3jax; False: not checked): the id of the config.json the caller read, which the weight files
    must carry (:class:`CheckpointChanged` otherwise)."""
    from tqdm.auto import tqdm

    reader = CheckpointReader(directory)
    check_save_id(reader, save_id)
    plan = tensor_plan(cfg, weights)
    require_mxfp8_storage(reader, plan)
    unexpected = {n for n in reader.names() if not IGNORED.search(n)}
    bad: list[str] = []
    bar = tqdm(plan, desc="loading checkpoint", unit="tensor", disable=not progress)
    for e in bar:
        np_dtype = None if e.mxfp8 else _np_dtype(e.spec.resolve_dtype(dtype))
        arr, used = _convert(reader, e, np_dtype)
        unexpected.difference_update(used)
        if not allow_nonfinite:
            bad += nonfinite_names(e, arr)
        yield e, arr
        del arr  # before converting the next leaf, so at most one converted leaf is alive here
    refuse_nonfinite(directory, bad)
    if unexpected:
        sample = sorted(unexpected)[:8]
        raise CheckpointError(
            f"{directory}: {len(unexpected)} unexpected tensor(s) not used by this config, e.g. {sample}; "
            "the config.json and the weights disagree"
        )


def saved_id(directory: str | Path) -> str | None:
    """The save id in ``directory``'s config.json (None: not saved by m3jax), read afresh."""
    _, d = read_config_json(directory)
    value = d.get(SAVE_ID_KEY) if isinstance(d, dict) else None
    return value if isinstance(value, str) else None


def check_save_id(reader: CheckpointReader, save_id: str | None | bool) -> None:
    """Refuse weight files of another save than the config.json read (``save_id``; False: no check)."""
    if save_id is not False and reader.save_id != save_id:
        raise CheckpointChanged(
            f"{reader.directory}: config.json is of save {save_id} but the weights are of save {reader.save_id}: "
            "the folder was replaced while being read, or its files were mixed; load it again")


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def load_params(
    directory: str | Path,
    cfg: M3Config,
    dtype="bfloat16",
    progress: bool = True,
    place: Callable[[tuple, np.ndarray], jax.Array] | None = None,
    weights: str = "dequantize",
    *,
    allow_nonfinite: bool = False,
    save_id: str | None | bool = False,
) -> dict:
    """Load a checkpoint into our parameter tree (``weights``: "dequantize" or "mxfp8", see the module).

    ``place(path, array)`` puts one leaf on device(s) (default: ``jax.device_put``); the sharding
    module passes a function that shards it. The host copy is dropped right after placement.
    ``allow_nonfinite`` and ``save_id``: see :func:`iter_checkpoint_arrays`.
    """
    place = place or (lambda path, a: jax.device_put(a))
    tree = jax.tree.map(lambda s: None, param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))
    for e, arr in iter_checkpoint_arrays(directory, cfg, dtype, progress, weights,
                                         allow_nonfinite=allow_nonfinite, save_id=save_id):
        parent = _get(tree, e.path[:-1])
        parent[e.path[-1]] = place(e.path, arr)
        del arr
    return tree


EMBED = "language_model.model.embed_tokens.weight"
# What m3jax computes in for a stored dtype: float16 values are all exact in float32.
_RUN_DTYPE = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float32"}


def checkpoint_dtype(directory: str | Path) -> str:
    """The dtype to run a checkpoint in, as transformers' ``dtype="auto"`` picks it: config.json's
    ``dtype`` (transformers >= 4.56) or ``torch_dtype``, at the top level or in ``text_config``; without
    either, the stored dtype of the token embedding (MXFP8 checkpoints keep it in BF16). A float16
    checkpoint runs in float32; m3jax computes in bfloat16 or float32."""
    path, d = read_config_json(directory)
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    key, name = next(((p + k, c[k]) for p, c in (("", d), ("text_config.", text))
                      for k in ("dtype", "torch_dtype") if c.get(k)), (None, None))
    if name is None:
        name = str(CheckpointReader(path.parent).read(EMBED).dtype)
    elif not isinstance(name, str):
        raise UnsupportedConfigError(f"{path}: {key}={name!r} is not a dtype name such as 'bfloat16'")
    if name not in _RUN_DTYPE:
        raise UnsupportedConfigError(f"{path}: dtype={name!r}; m3jax runs checkpoints stored in {sorted(_RUN_DTYPE)}")
    return _RUN_DTYPE[name]


# --------------------------------------------------------------------------------------------------
# Writing

# The dtypes a checkpoint is saved in: those checkpoint_dtype runs (integers would round the weights to 0).
SAVE_DTYPES = tuple(_RUN_DTYPE)


def dtype_name(dtype) -> str | None:
    """numpy's name of ``dtype`` (a string or dtype-like), or None when it names no dtype."""
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        return None


# The weight files a save writes.
_SAVED_FILE = re.compile(r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json")


def checkpoint_tensors(params: dict, cfg: M3Config, dtype=None, quantize_mxfp8_weights: bool = False):
    """Yield (official name, numpy tensor in torch layout) for every tensor of the checkpoint."""
    for e in tensor_plan(cfg):
        leaf = _get(params, e.path)
        if isinstance(leaf, MXFP8Weight):  # held MXFP8 (weights="mxfp8"): written from its exact fp32 values
            leaf = dequantize(leaf, jnp.float32)
        a = np.asarray(jax.device_get(leaf))
        if dtype is not None and e.spec.dtype == "model":
            a = a.astype(ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype))
        if e.kind == "copy":
            mats = [a]
        elif e.kind == "linear":
            mats = [a.reshape(math.prod(a.shape[: e.n_in]), -1).T]
        elif e.kind == "experts":
            mats = [x.T for x in a]
        else:  # patch
            mats = [a.T.reshape(e.patch_shape)]
        for name, m in zip(e.names, mats):
            if quantize_mxfp8_weights and is_mxfp8_quantized(name):
                q, s = quantize_mxfp8(np.asarray(m, np.float32))
                yield name, q
                yield name + "_scale_inv", s
            else:
                yield name, np.ascontiguousarray(m)


def save_checkpoint(
    params: dict,
    cfg: M3Config,
    directory: str | Path,
    *,
    dtype=None,
    max_shard_bytes: int = 4 << 30,
    quantize_mxfp8_weights: bool = False,
    overwrite: bool = False,
    extra_files: dict[str, bytes | str] | None = None,
) -> Path:
    """Write ``config.json`` + safetensors shards (+ index when several) in the official naming.

    ``quantize_mxfp8_weights`` writes the MXFP8 layout of the released MXFP8 repo.

    ``dtype``: None (as held) or one of :data:`SAVE_DTYPES`, for the leaves the model's dtype applies to.

    ``extra_files``: {file name: contents} saved with the weights (a tokenizer), in the same swap.

    A folder that already holds a checkpoint (``config.json``, shards, an index) is refused unless
    ``overwrite=True``; an empty or new folder is fine. Other ``*.safetensors`` files are refused
    before anything is written: a folder without an index is read whole.

    The save is atomic and single-writer: the files are written into a new hidden folder beside
    ``directory``, which then takes its place in one rename (:func:`m3jax.atomic.swap_in`); the
    other files of the folder are carried over (hard links where the filesystem allows), and the
    older checkpoint files this save does not rewrite (an index, shards of another count) are dropped
    with a warning naming them. A reader sees the old checkpoint or the new one, never a mix; a save
    cut short (a kill, a full disk) leaves the old folder as it was and a hidden staging folder that
    the next save of that folder removes. A second save into the same folder while one runs is
    refused (:class:`m3jax.atomic.FolderBusyError`). Every file records the save's id
    (:data:`SAVE_ID_KEY`), which the loader checks.
    """
    if dtype is not None and dtype_name(dtype) not in SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r}; a checkpoint is saved in one of {list(SAVE_DTYPES)} (or None: as held)")
    if not isinstance(max_shard_bytes, (int, float)) or not max_shard_bytes > 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r}; must be a positive number of bytes")
    extra_files = dict(extra_files or {})
    for name in extra_files:
        if Path(name).name != name or name == "config.json" or _SAVED_FILE.fullmatch(name):
            raise ValueError(f"extra_files: {name!r} must be a plain file name other than the checkpoint's own files")
    directory = Path(directory).resolve()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with folder_lock(directory):
        entries = sorted(directory.iterdir()) if directory.is_dir() else []
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"{directory} is a file, not a folder")
        foreign = [f.name for f in entries if f.name.endswith(".safetensors") and not _SAVED_FILE.fullmatch(f.name)]
        if foreign:
            raise CheckpointError(
                f"{directory}: holds {foreign}, which a checkpoint save does not write; the loader reads every "
                "*.safetensors file of a folder without an index, so they would be mixed with the new weights: "
                "move them or save elsewhere"
            )
        held = [f.name for f in entries if f.name == "config.json" or _SAVED_FILE.fullmatch(f.name)]
        if held and not overwrite:
            raise CheckpointError(
                f"{directory}: already holds a checkpoint ({held}); pass overwrite=True to replace it, or save elsewhere"
            )
        for old in directory.parent.glob(f".{directory.name}.staging-*"):  # left by a save that was killed
            shutil.rmtree(old, ignore_errors=True)
        staging = staging_folder(directory)
        try:
            names = _write_checkpoint(params, cfg, staging, dtype, max_shard_bytes, quantize_mxfp8_weights,
                                      extra_files)
            # The folder's other files (a README, a tokenizer the save does not replace) go with it.
            for f in entries:
                if f.name not in names and f.name != "config.json" and not _SAVED_FILE.fullmatch(f.name):
                    _carry(f, staging / f.name)
            if directory.is_dir():
                shutil.copymode(directory, staging)
            swap_in(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    stale = [f.name for f in entries if _SAVED_FILE.fullmatch(f.name) and f.name not in names]
    if stale:
        warnings.warn(f"{directory}: dropped {stale} of the checkpoint saved there before; left in place they "
                      "would be loaded instead of, or mixed with, the new weights", stacklevel=2)
    return directory


def _carry(src: Path, dst: Path) -> None:
    """Put ``src`` (a file or a folder) at ``dst``: hard links where the filesystem allows, else copies."""
    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    elif src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        link(src, dst)


def _write_checkpoint(params, cfg, folder: Path, dtype, max_shard_bytes, quantize_mxfp8_weights,
                      extra_files: dict) -> list[str]:
    """Write a whole checkpoint into the empty ``folder``; returns the names of the files written."""
    save_id = new_save_id()
    meta = {SAVE_ID_KEY: save_id}
    # Shards are flushed as they fill (host memory stays one shard); names get their final
    # "-of-N" once N is known.
    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush():
        path = folder / f"shard-{len(written):05d}.tmp"
        write_safetensors(path, shard, meta)
        written.append((path, list(shard)))

    for name, a in checkpoint_tensors(params, cfg, dtype, quantize_mxfp8_weights):
        if size and size + a.nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = a
        size += a.nbytes
        total += a.nbytes
    flush()
    names = (["model.safetensors"] if len(written) == 1 else
             [f"model-{k + 1:05d}-of-{len(written):05d}.safetensors" for k in range(len(written))] +
             ["model.safetensors.index.json"])
    if len(written) == 1:
        written[0][0].rename(folder / "model.safetensors")
    else:
        weight_map = {}
        for fname, (path, tensor_names) in zip(names, written):
            path.rename(folder / fname)
            weight_map.update({n: fname for n in tensor_names})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total, **meta}, "weight_map": weight_map}, indent=1))
    for fname, data in extra_files.items():
        (folder / fname).write_bytes(data.encode() if isinstance(data, str) else data)
    hf = config_to_hf(dataclasses.replace(cfg, quantization="mxfp8" if quantize_mxfp8_weights else cfg.quantization))
    # The dtype the weights were saved in (for MXFP8, that of the unquantized ones), as transformers writes it.
    hf["dtype"] = jnp.dtype(dtype if dtype is not None else _get(params, ("text", "embed")).dtype).name
    hf[SAVE_ID_KEY] = save_id
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    return names + list(extra_files) + ["config.json"]


# --------------------------------------------------------------------------------------------------
# Partial reads (sharded loading): one device's slice of one leaf, straight from the memory-mapped files


def _flat_range(index: tuple, dims: tuple[int, ...]) -> tuple[int, int, tuple]:
    """Row range of the flattened ``dims`` that covers ``index`` (slices over those dims).

    When only the leading dim is sliced (the others whole) the range is exact and the residual index is
    all-whole; otherwise the whole range is read and the index is applied after. Returns (lo, hi, residual).
    """
    whole = tuple(slice(None) for _ in dims)
    if not dims:
        return 0, 1, ()
    inner = math.prod(dims[1:])
    rest_whole = all(s.indices(d) == (0, d, 1) for s, d in zip(index[1:], dims[1:]))
    lo, hi, step = index[0].indices(dims[0])
    if rest_whole and step == 1:
        return lo * inner, hi * inner, whole
    return 0, math.prod(dims), tuple(index)


def _read_rows_cols(reader: CheckpointReader, name: str, hf_shape, rows: tuple[int, int], cols: tuple[int, int]):
    """fp32/stored-float block ``tensor[r0:r1, c0:c1]`` of a 2-D checkpoint tensor (MXFP8 dequantised on
    just the 32-column groups that cover it). Returns (array, names consumed)."""
    a = reader.read_checked(name, hf_shape)
    (r0, r1), (c0, c1) = rows, cols
    if a.dtype == ml_dtypes.float8_e4m3fn:
        scale_name = name + "_scale_inv"
        g0, g1 = c0 // MXFP8_BLOCK, -(-c1 // MXFP8_BLOCK)
        scale = reader.read(scale_name)
        if scale.shape != (a.shape[0], -(-a.shape[1] // MXFP8_BLOCK)) or scale.dtype != np.uint8:
            reader.dequantize(name, np.asarray(a[:1]), np.asarray(scale[:1]))  # raises the detailed error
        cb1 = min(a.shape[1], g1 * MXFP8_BLOCK)
        block = np.asarray(a[r0:r1, g0 * MXFP8_BLOCK : cb1])
        deq = reader.dequantize(name, block, np.asarray(scale[r0:r1, g0:g1]))
        return deq[:, c0 - g0 * MXFP8_BLOCK : c1 - g0 * MXFP8_BLOCK], [name, scale_name]
    return np.asarray(a[r0:r1, c0:c1]), [name]


def _linear_slice(read_block: Callable, shape: tuple[int, ...], n_in: int, index: tuple) -> np.ndarray:
    """Slice ``index`` of a linear leaf of ``shape`` (ours = hf.T.reshape(in_dims + out_dims), hf =
    [prod(out_dims), prod(in_dims)]), reading only ``read_block((r0, r1), (c0, c1))`` of the hf tensor
    (exact when the leading dim of the leaf's output or input group is the sliced one)."""
    in_dims, out_dims = shape[:n_in], shape[n_in:]
    c0, c1, in_rest = _flat_range(index[:n_in], in_dims)
    r0, r1, out_rest = _flat_range(index[n_in:], out_dims)
    block = read_block((r0, r1), (c0, c1))

    def sub(dims, lo, hi, rest):  # shape of the read range in the leaf's dims
        if rest and any(s != slice(None) for s in rest):
            return dims
        inner = math.prod(dims[1:])
        return ((hi - lo) // inner,) + tuple(dims[1:])

    a = block.T.reshape(sub(in_dims, c0, c1, in_rest) + sub(out_dims, r0, r1, out_rest))
    return np.ascontiguousarray(a[tuple(in_rest) + tuple(out_rest)])


def read_entry_shard(reader: CheckpointReader, e: Entry, index: tuple | None, out_dtype,
                     part: str | None = None) -> tuple[np.ndarray, list[str]]:
    """The slice ``index`` (a tuple of slices over the leaf's shape, as ``jax.make_array_from_callback``
    passes it) of one leaf, in our layout and ``out_dtype``, reading only what the slice needs:

    * ``experts``: only the experts in ``index[0]`` are opened (one [Fe, D] matrix each);
    * ``linear``: only the checkpoint rows / columns the slice covers (exact when the leading dim of
      the leaf's output or input group is the sliced one, which is what the sharding rules produce);
    * ``copy``: a slice of the memory map; ``patch`` (vision Conv3d, small) is read whole;
    * an MXFP8 entry (``weights="mxfp8"``): ``part`` "values" or "scales", ``index`` a slice of that
      part's shape, read as stored (``out_dtype`` unused).

    Returns (array, checkpoint names consumed). Equal to ``_convert(...)[0][index]``.
    """
    if e.mxfp8:
        if part == "scales":  # the scales' slice as a slice of the values (the grouped axis x 32)
            ax = e.spec.group_axis
            s_index = _full_index(e.spec.scales.shape, index)
            lo, hi, _ = s_index[ax].indices(e.spec.scales.shape[ax])
            index = s_index[:ax] + (slice(lo * MXFP8_BLOCK, hi * MXFP8_BLOCK),) + s_index[ax + 1:]
        leaf, used = _mxfp8_leaf(reader, e, index, (part,))
        return leaf[part], used
    shape = e.spec.shape
    index = _full_index(shape, index)
    if e.kind == "experts":
        lo, hi, step = index[0].indices(shape[0])
        mats, used = [], []
        for idx in range(lo, hi, step):
            a, u = reader.read_dequantized(e.names[idx], e.hf_shape())
            mats.append(np.asarray(a.T[index[1:]]).astype(out_dtype))
            used += u
        return _stack(mats, shape, index, out_dtype), used
    if e.kind == "patch":
        a, used = _convert(reader, e, out_dtype)
        return np.ascontiguousarray(a[index]), used
    if e.kind == "copy":
        a = reader.read_checked(e.names[0], shape)
        if a.dtype == ml_dtypes.float8_e4m3fn:
            full, used = reader.read_dequantized(e.names[0], shape)
            return np.asarray(full[index]).astype(out_dtype), used
        return np.asarray(a[index]).astype(out_dtype), [e.names[0]]
    used = []

    def read_block(rows, cols):
        block, u = _read_rows_cols(reader, e.names[0], e.hf_shape(), rows, cols)
        used.extend(u)
        return block

    return _linear_slice(read_block, shape, e.n_in, index).astype(out_dtype), used
