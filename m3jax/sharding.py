"""Sharding over N devices: mesh, the one logical-axis rule table, param / cache shardings and sharded
checkpoint loading. docs/SHARDING.md has the strategy for MiniMax-M3 on 8 GPUs with its arithmetic;
the MSA pieces that run inside ``shard_map`` live in :mod:`m3jax.msa.parallel`.

* Mesh: ``make_mesh(n, data=1)`` -> axes ``("data", "model")`` (Auto axis types: shardings of the
  parameters propagate through the unchanged model code; the expert-parallel MoE and the context-
  parallel attention are explicit ``jax.shard_map`` regions).
* Rules: :data:`RULES` maps every logical axis a :class:`m3jax.params.ParamSpec` (or an activation /
  cache array) declares to a mesh axis. A dim that the mesh axis does not divide is replicated (e.g.
  M3's 4 KV heads on 8 devices); two logical axes of one array mapped to the same mesh axis are an
  error (:class:`ShardingRuleError`).
* The same code runs for 1, 2, 4, 8 devices: with a 1-device mesh every spec is replicated.
"""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from m3jax.cache import LayerCache, PagedCache, init_cache
from m3jax.checkpoint import (
    IGNORED,
    CheckpointError,
    CheckpointReader,
    check_save_id,
    get_path,
    nonfinite_names,
    read_entry_shard,
    refuse_nonfinite,
    require_mxfp8_storage,
    tensor_plan,
)
from m3jax.config import M3Config
from m3jax.layers import MXFP8Weight
from m3jax.mesh_axes import DATA, MESH_AXES, MODEL, ShardingRuleError  # noqa: F401  (re-exported)
from m3jax.params import ParamSpec, param_specs


class MXFP8ShardingError(ShardingRuleError):
    """An MXFP8 weight whose input axis would be split inside a 32-input scale block."""


# The one table: logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters (m3jax.params)
    ("vocab", MODEL),  # embed rows and lm_head columns: 200064 / 8 = 25008
    ("embed", None),  # the residual stream is never split (every matmul contracts or produces it)
    ("q_heads", MODEL),  # 64 / 8 = 8 query heads per device (wq columns, wo rows)
    ("kv_heads", MODEL),  # 4 KV / index heads: split when the axis divides 4, replicated on 8
    ("head_dim", None),
    ("mlp", MODEL),  # dense (12288 / 8) and shared-expert (3072 / 8) width, projector width
    ("experts", MODEL),  # 128 / 8 = 16 experts per device (expert parallel, all-to-all dispatch)
    ("expert_mlp", None),  # whole experts per device: no collective inside an expert
    ("vis_embed", None),
    ("vis_heads", MODEL),
    ("vis_mlp", MODEL),
    # activations
    ("batch", DATA),
    ("seq", None),
    ("tokens", (DATA, MODEL)),  # flattened tokens entering the expert-parallel MoE
    ("act_embed", None),
    ("act_heads", MODEL),
    ("act_vocab", MODEL),
    # caches (m3jax.cache): pages split over the model axis = context parallelism of the cache
    ("cache_pages", MODEL),
    ("cache_slot", None),
    ("cache_kv_heads", None),
    ("cache_dim", None),
)

CACHE_KV_AXES = ("cache_pages", "cache_slot", "cache_kv_heads", "cache_dim")
CACHE_INDEX_AXES = ("cache_pages", "cache_slot", "cache_dim")


# --------------------------------------------------------------------------------------------------
# Mesh and specs


def make_mesh(n_devices: int | None = None, *, data: int = 1, devices=None) -> jax.sharding.Mesh:
    """Mesh ``(data, model)`` over the first ``n_devices`` visible devices (all by default)."""
    devices = list(devices if devices is not None else jax.devices())
    n = n_devices or len(devices)
    if n > len(devices) or n % data:
        raise ValueError(f"cannot build a ({data}, {n // max(data, 1)}) mesh from {len(devices)} devices")
    return jax.make_mesh((data, n // data), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[:n])


def rule_mesh_axes(rule) -> tuple[str, ...]:
    """The mesh axes a sharding rule names (None, one axis, or a tuple of axes) as a tuple."""
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def spec_for(axes: Iterable[str | None], shape: Iterable[int], mesh, rules=RULES) -> P:
    """PartitionSpec of one array from its logical axes.

    Raises :class:`ShardingRuleError` when a logical axis has no rule or when two of the array's
    logical axes map to the same mesh axis. A dim the mapped mesh axes do not divide is replicated.
    """
    table = dict(rules)
    axes, shape = tuple(axes), tuple(shape)
    used: dict[str, str] = {}
    out = []
    for name, dim in zip(axes, shape):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ShardingRuleError(f"logical axis {name!r} has no rule in the sharding table")
        ms = rule_mesh_axes(table[name])
        for m in ms:
            if m in used:
                raise ShardingRuleError(
                    f"logical axes {used[m]!r} and {name!r} of one array {axes} both map to mesh axis {m!r}"
                )
            used[m] = name
        ms = tuple(m for m in ms if m in mesh.shape and mesh.shape[m] > 1)
        size = math.prod(mesh.shape[m] for m in ms)
        if not ms or dim % size:
            out.append(None)
        else:
            out.append(ms[0] if len(ms) == 1 else ms)
    return P(*out)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def mxfp8_partition_specs(spec: MXFP8Weight, mesh, rules=RULES, name: str = "") -> MXFP8Weight:
    """PartitionSpecs of an MXFP8 weight's values and scales: both as the weight it replaces (its logical
    axes), so each device holds the scales of its own values. Raises :class:`MXFP8ShardingError` when
    the split of the grouped input axis is not a multiple of 32 inputs (the scales' axis, 1/32 as long,
    would not split the same way)."""
    vs = spec_for(spec.values.axes, spec.values.shape, mesh, rules)
    ss = spec_for(spec.scales.axes, spec.scales.shape, mesh, rules)
    ax = spec.group_axis
    if tuple(vs) != tuple(ss):
        n = spec.values.shape[ax]
        raise MXFP8ShardingError(
            f"MXFP8 weight {name or spec.values.axes}: its input axis {spec.values.axes[ax]!r} ({n} inputs) is split "
            f"as {tuple(vs)} but its {n // 32} scale blocks of 32 inputs do not split that way; every shard of "
            "an MXFP8 weight must hold whole 32-input blocks (load with weights='dequantize', or a mesh that "
            "divides the blocks)")
    return MXFP8Weight(vs, ss)


def _is_spec_or_mxfp8(x) -> bool:
    return isinstance(x, (ParamSpec, MXFP8Weight))


def param_partition_specs(cfg: M3Config, mesh, rules=RULES, weights: str = "dequantize") -> dict:
    """PartitionSpec tree of the parameters (``weights="mxfp8"``: of the tree ``load_pretrained`` holds then)."""
    def one(path, s):
        if isinstance(s, MXFP8Weight):
            return mxfp8_partition_specs(s, mesh, rules, jax.tree_util.keystr(path))
        return spec_for(s.axes, s.shape, mesh, rules)

    return jax.tree_util.tree_map_with_path(one, param_specs(cfg, weights), is_leaf=_is_spec_or_mxfp8)


def param_shardings(cfg: M3Config, mesh, rules=RULES, weights: str = "dequantize") -> dict:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_partition_specs(cfg, mesh, rules, weights),
                        is_leaf=lambda x: isinstance(x, P))


def validate_rules(cfg: M3Config, mesh, rules=RULES) -> list[str]:
    """Check every parameter against the table; returns the replicated-by-divisibility notes."""
    notes = []
    table = dict(rules)
    for s in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec):
        spec = spec_for(s.axes, s.shape, mesh, rules)
        for name, dim, got in zip(s.axes, s.shape, tuple(spec) + (None,) * (len(s.shape) - len(spec))):
            want = tuple(m for m in rule_mesh_axes(table.get(name)) if mesh.shape.get(m, 1) > 1) if name else ()
            if want and got is None:
                notes.append(f"{name}={dim} replicated (mesh axes {want} of size "
                             f"{math.prod(mesh.shape[m] for m in want)} do not divide it)")
    return sorted(set(notes))


def weights_of(params: dict) -> str:
    """"mxfp8" for a tree holding :class:`MXFP8Weight` leaves (``load_pretrained(..., weights="mxfp8")``),
    else "dequantize": the ``weights`` its specs and shardings are declared with."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, MXFP8Weight))
    return "mxfp8" if any(isinstance(x, MXFP8Weight) for x in leaves) else "dequantize"


def shard_params(params: dict, cfg: M3Config, mesh, rules=RULES) -> dict:
    """Place an existing parameter tree with the rule shardings (a no-op for leaves already placed so)."""
    return jax.device_put(params, param_shardings(cfg, mesh, rules, weights_of(params)))


def resident_bytes(tree) -> dict:
    """{device: bytes of the tree's shards that live on it}."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def planned_param_bytes(cfg: M3Config, mesh, dtype_bytes: int | Callable[[ParamSpec], float], rules=RULES,
                        weights: str = "dequantize") -> float:
    """Per-device parameter bytes under the rules (what :func:`resident_bytes` should report);
    ``weights="mxfp8"``: the fp8 values and uint8 scales at 1 byte each."""
    total = 0.0
    for s in jax.tree.leaves(param_specs(cfg, weights), is_leaf=_is_spec):
        spec = spec_for(s.axes, s.shape, mesh, rules)
        split = math.prod(mesh.shape[m] for e in spec if e is not None for m in rule_mesh_axes(e))
        if s.dtype in ("float8_e4m3fn", "uint8"):
            per_elem = 1
        else:
            per_elem = dtype_bytes(s) if callable(dtype_bytes) else (4 if s.dtype == "float32" else dtype_bytes)
        total += math.prod(s.shape) / split * per_elem
    return total


# --------------------------------------------------------------------------------------------------
# Cache


def striped_page_table(batch: int, max_pages: int, n_shards: int) -> np.ndarray:
    """Page table whose logical block j of every sequence lives on cache shard ``j % n_shards``.

    Physical pages are split in ``n_shards`` equal contiguous ranges (one per device of the model
    axis); striping spreads every prefix of the context over all devices, so each prefill chunk's
    index scoring and attention work is balanced across the context-parallel devices.
    """
    if max_pages % n_shards:
        return np.arange(batch * max_pages, dtype=np.int32).reshape(batch, max_pages)
    per = batch * max_pages // n_shards
    j = np.arange(max_pages)
    b = np.arange(batch)[:, None]
    return ((j % n_shards) * per + b * (max_pages // n_shards) + j // n_shards).astype(np.int32)


def padded_capacity(capacity: int, cfg: M3Config, mesh) -> int:
    """Capacity rounded up to whole pages, a multiple of the model axis per sequence (so the page axis
    splits evenly; e.g. 1,000,000 -> 1,000,448 tokens = 7816 pages of 128 on 8 devices)."""
    unit = cfg.text.index_block_size * mesh.shape[MODEL]
    return -(-capacity // unit) * unit


def init_sharded_cache(cfg: M3Config, batch: int, capacity: int, dtype, mesh, rules=RULES) -> PagedCache:
    """:func:`m3jax.cache.init_cache` created directly in its shards (no full copy on any device), with
    the capacity padded by :func:`padded_capacity` and a block-striped page table."""
    capacity = padded_capacity(capacity, cfg, mesh)
    shape = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, dtype))
    out = cache_shardings(shape, mesh, rules)
    table = striped_page_table(batch, shape.page_table.shape[1], mesh.shape[MODEL])

    def make():
        c = init_cache(cfg, batch, capacity, dtype)
        return PagedCache(c.layers, jnp.asarray(table))

    return jax.jit(make, out_shardings=out)()


def cache_shardings(cache: PagedCache, mesh, rules=RULES) -> PagedCache:
    def layer(lc: LayerCache) -> LayerCache:
        kv = NamedSharding(mesh, spec_for(CACHE_KV_AXES, lc.k.shape, mesh, rules))
        ik = None if lc.ik is None else NamedSharding(mesh, spec_for(CACHE_INDEX_AXES, lc.ik.shape, mesh, rules))
        return LayerCache(kv, kv, ik)

    return PagedCache([layer(lc) for lc in cache.layers], NamedSharding(mesh, P()))


# --------------------------------------------------------------------------------------------------
# Sharded loading


def load_sharded(
    directory: str | Path,
    cfg: M3Config,
    mesh,
    dtype="bfloat16",
    rules=RULES,
    read_log: dict | None = None,
    progress: bool = False,
    weights: str = "dequantize",
    *,
    allow_nonfinite: bool = False,
    save_id: str | None | bool = False,
) -> dict:
    """Load a checkpoint straight into its shards: each device's slice is read from the memory-mapped
    safetensors files by ``jax.make_array_from_callback`` (experts: only the local ones; linears: only
    the local rows / columns). No full copy of a sharded leaf exists on host or device.

    ``read_log``, if given, collects {checkpoint name: times read} (tests check expert locality).
    ``allow_nonfinite`` and ``save_id``: as in :func:`m3jax.checkpoint.iter_checkpoint_arrays` (each
    slice is checked as it is read).
    """
    from tqdm.auto import tqdm

    reader = CheckpointReader(directory)
    check_save_id(reader, save_id)
    plan = tensor_plan(cfg, weights)
    bad: set[str] = set()
    expected = set()
    for e in plan:
        for n in e.names:
            expected.add(n)
            if reader.has(n + "_scale_inv"):
                expected.add(n + "_scale_inv")
    missing = sorted(n for e in plan for n in e.names if not reader.has(n))
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    require_mxfp8_storage(reader, plan)
    unexpected = {n for n in reader.names() if not IGNORED.search(n)} - expected
    if unexpected:
        raise CheckpointError(
            f"{directory}: {len(unexpected)} unexpected tensor(s) not used by this config, e.g. {sorted(unexpected)[:8]}; "
            "the config.json and the weights disagree"
        )
    tree = jax.tree.map(lambda s: None, param_specs(cfg, weights), is_leaf=_is_spec)
    # One progress bar per file (a leaf counts under the file of its first tensor).
    by_file: dict[str, list] = {}
    for e in plan:
        by_file.setdefault(reader.file_of(e.names[0]).name, []).append(e)
    entries = (e for i, (name, group) in enumerate(sorted(by_file.items()))
               for e in tqdm(group, desc=f"loading {name} ({i + 1}/{len(by_file)}, sharded)", unit="tensor",
                             disable=not progress))
    for e in entries:
        def read(index, e=e, part=None, np_dtype=None):
            a, used = read_entry_shard(reader, e, index, np_dtype, part)
            if not allow_nonfinite and part != "scales":
                bad.update(nonfinite_names(e, a, index))
            if read_log is not None:
                for n in used:
                    read_log[n] = read_log.get(n, 0) + 1
            return a

        if e.mxfp8:  # values and scales, each device reading its blocks of both (mxfp8_partition_specs)
            specs = mxfp8_partition_specs(e.spec, mesh, rules, "/".join(map(str, e.path)))
            vs, ss = specs.values, specs.scales
            leaf = MXFP8Weight(*(jax.make_array_from_callback(s.shape, NamedSharding(mesh, ps),
                                                              functools.partial(read, part=part))
                                 for s, ps, part in ((e.spec.values, vs, "values"), (e.spec.scales, ss, "scales"))))
        else:
            jdt = e.spec.resolve_dtype(dtype)
            np_dtype = np.dtype(ml_dtypes.bfloat16) if jdt == jnp.bfloat16 else np.dtype(jdt)
            sharding = NamedSharding(mesh, spec_for(e.spec.axes, e.spec.shape, mesh, rules))
            leaf = jax.make_array_from_callback(e.spec.shape, sharding, functools.partial(read, np_dtype=np_dtype))
        get_path(tree, e.path[:-1])[e.path[-1]] = leaf
    refuse_nonfinite(directory, sorted(bad))
    return tree


# --------------------------------------------------------------------------------------------------
# Running under a mesh


def use_mesh(mesh):
    """Context in which the model runs sharded (expert-parallel MoE switches on); null for None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
