"""Sharding over N devices: mesh, the one logical-axis rule table, param / cache shardings, sharded
checkpoint loading, and the shard_map pieces (context-parallel MSA with an LSE merge, kernels per head
shard). docs/SHARDING.md has the strategy for MiniMax-M3 on 8 GPUs with its arithmetic.

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
import dataclasses
import math
import warnings
from pathlib import Path
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from m3jax.cache import LayerCache, PagedCache
from m3jax.config import M3Config
from m3jax.moe import EXPERT_AXIS
from m3jax.params import ParamSpec, param_specs

DATA = "data"
MODEL = EXPERT_AXIS  # "model": tensor, expert and context parallelism share one axis (see docs/SHARDING.md)
MESH_AXES = (DATA, MODEL)


class ShardingRuleError(ValueError):
    """A rule table that cannot shard an array (collision, unknown logical axis)."""


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


def _mesh_axes(rule) -> tuple[str, ...]:
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
        ms = _mesh_axes(table[name])
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


def param_partition_specs(cfg: M3Config, mesh, rules=RULES) -> dict:
    return jax.tree.map(lambda s: spec_for(s.axes, s.shape, mesh, rules), param_specs(cfg), is_leaf=_is_spec)


def param_shardings(cfg: M3Config, mesh, rules=RULES) -> dict:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_partition_specs(cfg, mesh, rules),
                        is_leaf=lambda x: isinstance(x, P))


def validate_rules(cfg: M3Config, mesh, rules=RULES) -> list[str]:
    """Check every parameter against the table; returns the replicated-by-divisibility notes."""
    notes = []
    table = dict(rules)
    for s in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec):
        spec = spec_for(s.axes, s.shape, mesh, rules)
        for name, dim, got in zip(s.axes, s.shape, tuple(spec) + (None,) * (len(s.shape) - len(spec))):
            want = tuple(m for m in _mesh_axes(table.get(name)) if mesh.shape.get(m, 1) > 1) if name else ()
            if want and got is None:
                notes.append(f"{name}={dim} replicated (mesh axes {want} of size "
                             f"{math.prod(mesh.shape[m] for m in want)} do not divide it)")
    return sorted(set(notes))


def shard_params(params: dict, cfg: M3Config, mesh, rules=RULES) -> dict:
    """Place an existing parameter tree with the rule shardings (a no-op for leaves already placed so)."""
    return jax.device_put(params, param_shardings(cfg, mesh, rules))


def resident_bytes(tree) -> dict:
    """{device: bytes of the tree's shards that live on it}."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def planned_param_bytes(cfg: M3Config, mesh, dtype_bytes: int | Callable[[ParamSpec], float], rules=RULES) -> float:
    """Per-device parameter bytes under the rules (what :func:`resident_bytes` should report)."""
    total = 0.0
    for s in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec):
        spec = spec_for(s.axes, s.shape, mesh, rules)
        split = math.prod(mesh.shape[m] for e in spec if e is not None for m in _mesh_axes(e))
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
    from m3jax.cache import init_cache

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


def shard_cache(cache: PagedCache, mesh, rules=RULES, stripe: bool = True) -> PagedCache:
    """Place a cache on the mesh (pages over the model axis); optionally stripe its page table."""
    if stripe:
        n = mesh.shape[MODEL]
        b, maxp = cache.page_table.shape
        cache = PagedCache(cache.layers, jnp.asarray(striped_page_table(b, maxp, n)))
    return jax.device_put(cache, cache_shardings(cache, mesh, rules))


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
) -> dict:
    """Load a checkpoint straight into its shards: each device's slice is read from the memory-mapped
    safetensors files by ``jax.make_array_from_callback`` (experts: only the local ones; linears: only
    the local rows / columns). No full copy of a sharded leaf exists on host or device.

    ``read_log``, if given, collects {checkpoint name: times read} (tests check expert locality).
    """
    from tqdm.auto import tqdm

    from m3jax.checkpoint import IGNORED, CheckpointError, CheckpointReader, _get, read_entry_shard, tensor_plan

    reader = CheckpointReader(directory)
    plan = tensor_plan(cfg)
    expected = set()
    for e in plan:
        for n in e.names:
            expected.add(n)
            if reader.has(n + "_scale_inv"):
                expected.add(n + "_scale_inv")
    missing = sorted(n for e in plan for n in e.names if not reader.has(n))
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    unexpected = {n for n in reader.names() if not IGNORED.search(n)} - expected
    if unexpected:
        raise CheckpointError(
            f"{directory}: {len(unexpected)} unexpected tensor(s) not used by this config, e.g. {sorted(unexpected)[:8]}; "
            "the config.json and the weights disagree"
        )
    tree = jax.tree.map(lambda s: None, param_specs(cfg), is_leaf=_is_spec)
    for e in tqdm(plan, desc="loading checkpoint (sharded)", unit="tensor", disable=not progress):
        jdt = e.spec.resolve_dtype(dtype)
        np_dtype = np.dtype(ml_dtypes.bfloat16) if jdt == jnp.bfloat16 else np.dtype(jdt)
        sharding = NamedSharding(mesh, spec_for(e.spec.axes, e.spec.shape, mesh, rules))

        def read(index, e=e, np_dtype=np_dtype):
            a, used = read_entry_shard(reader, e, index, np_dtype)
            if read_log is not None:
                for n in used:
                    read_log[n] = read_log.get(n, 0) + 1
            return a

        _get(tree, e.path[:-1])[e.path[-1]] = jax.make_array_from_callback(e.spec.shape, sharding, read)
    return tree


# --------------------------------------------------------------------------------------------------
# Running under a mesh


def use_mesh(mesh):
    """Context in which the model runs sharded (expert-parallel MoE switches on); null for None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def sharded_forward(params: dict, input_ids, cfg: M3Config, mesh, rules=RULES):
    """Text forward (logits [B, T, V] fp32) as one ``jax.jit`` with in/out shardings from the rules."""
    from m3jax.model import multimodal_forward

    ids = jnp.asarray(input_ids, jnp.int32)
    batch = NamedSharding(mesh, spec_for(("batch", "seq"), ids.shape, mesh, rules))
    logits = NamedSharding(mesh, spec_for(("batch", "seq", "act_vocab"), ids.shape + (cfg.text.vocab_size,), mesh, rules))
    fn = jax.jit(
        lambda p, i: multimodal_forward(p, i, None, None, cfg, None, None),
        in_shardings=(param_shardings(cfg, mesh, rules), batch),
        out_shardings=(logits, None),
    )
    with jax.set_mesh(mesh):
        return fn(params, jax.device_put(ids, batch))


def head_parallel(kernel: Callable, mesh, *, q_axes: int = 2, kv_axes: int | None = 2, axis: str = MODEL) -> Callable:
    """Run an attention kernel ``kernel(q, k, v, *rest)`` (q [B, T, N, H], k/v [B, S, K, H]) inside
    ``jax.shard_map`` with heads split over ``axis``: each device runs the unmodified (e.g. Pallas)
    kernel on its N / n query heads. KV heads are split with them when n divides K, else every device
    keeps the KV heads of its query heads' groups (a slice of the replicated K/V).
    Extra arguments (block ids [B, K, T, topk], positions) follow the KV heads or are replicated.
    """
    n = mesh.shape[axis]

    def call(q, k, v, block_idx, *rest):
        nh, kh = q.shape[q_axes], k.shape[2]
        if nh % n:
            raise ShardingRuleError(f"{nh} query heads do not split over {n} devices")
        g = nh // kh
        split_kv = kh % n == 0
        qspec = P(*([None] * q_axes + [axis]))

        def body(q_l, k_l, v_l, b_l, *r):
            if not split_kv:  # the KV groups of this device's query heads (one group when n >= K)
                me = jax.lax.axis_index(axis)
                per = nh // n
                g0 = me * per // g
                ng = max(1, per // g)
                k_l = jax.lax.dynamic_slice_in_dim(k_l, g0, ng, axis=2)
                v_l = jax.lax.dynamic_slice_in_dim(v_l, g0, ng, axis=2)
                b_l = jax.lax.dynamic_slice_in_dim(b_l, g0, ng, axis=1)
            return kernel(q_l, k_l, v_l, b_l, *r)

        kv_spec = P(None, None, axis) if split_kv else P()
        b_spec = P(None, axis) if split_kv else P()
        return jax.shard_map(
            body, mesh=mesh, in_specs=(qspec, kv_spec, kv_spec, b_spec) + (P(),) * len(rest), out_specs=qspec,
            check_vma=False,
        )(q, k, v, block_idx, *rest)

    return call


def context_parallel_msa(
    q: jax.Array, iq: jax.Array, k_local: jax.Array, v_local: jax.Array, ik_local: jax.Array, q_pos: jax.Array,
    mesh, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0, axis: str = MODEL,
) -> jax.Array:
    """MSA over a context split block-striped over ``axis`` (logical block j on device j % n).

    q [B, C, N, H] and iq [B, C, Hi, Hx] are replicated (the query chunk); ``k_local``/``v_local``
    [n, B, S/n, K, H] and ``ik_local`` [n, B, S/n, Hx] hold each device's blocks (leading axis sharded).
    Per device: block-max index scores of the local blocks -> local top-k candidates (forced blocks
    ranked as :func:`m3jax.msa.select_blocks` does) -> all-gather of n * topk candidates -> global
    top-k (ties to the lower block id) -> attention over the selected blocks that are local, with its
    log-sum-exp -> merge of the n partials by LSE (pmax, psum). Equals ``msa.sparse_attention`` with
    ``msa.select_blocks`` on the unsplit context. Returns ([B, C, N, H] in q.dtype, block ids
    int32 [B, Hi, C, topk] in select_blocks' order).
    """
    n = mesh.shape[axis]
    neg = float("-inf")

    def body(q, iq, k, v, ik, q_pos):
        k, v, ik = k[0], v[0], ik[0]
        me = jax.lax.axis_index(axis)
        b, c, nh, h = q.shape
        s_loc, kh = k.shape[1], k.shape[2]
        nb_loc = s_loc // block_size
        gid = jnp.arange(nb_loc) * n + me  # global block id of each local block
        kpos = (gid[:, None] * block_size + jnp.arange(block_size)).reshape(-1)  # [S_loc]
        # 1. local block-max index scores (fp32, -inf for future keys), as msa.block_scores
        s = jnp.einsum("bchx,bsx->bhcs", iq.astype(jnp.float32), ik.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
        s = jnp.where(kpos[None, None, None, :] > q_pos[:, None, :, None], neg, s)
        scores = s.reshape(*s.shape[:3], nb_loc, block_size).max(-1)  # [B, Hi, C, nb_loc]
        # 2. rank as select_blocks: forced blocks get huge ordered priorities
        own = (q_pos // block_size)[:, None, :, None]
        j = gid[None, None, None, :]
        local = (j <= own) & (j > own - local_blocks)
        prio = jnp.where(local, 1.0 + local_blocks - (own - j), jnp.where((j < init_blocks) & (j <= own), 0.5, 0.0))
        ranked = jnp.where(prio > 0, 1e38 + prio * 1e36, scores)
        ranked = jnp.where(ranked == 0, 0.0, ranked)
        kk = min(topk, nb_loc)
        vals, li = jax.lax.top_k(ranked, kk)
        ids = gid[li]
        # 3. global top-k over all devices' candidates, ties to the lower block id
        all_vals = jnp.moveaxis(jax.lax.all_gather(vals, axis), 0, -2).reshape(*vals.shape[:3], n * kk)
        all_ids = jnp.moveaxis(jax.lax.all_gather(ids, axis), 0, -2).reshape(*ids.shape[:3], n * kk)
        order = jnp.argsort(all_ids, axis=-1)
        all_vals = jnp.take_along_axis(all_vals, order, -1)
        all_ids = jnp.take_along_axis(all_ids, order, -1)
        gv, gi = jax.lax.top_k(all_vals, topk)
        sel = jnp.where(gv == neg, -1, jnp.take_along_axis(all_ids, gi, -1)).astype(jnp.int32)  # [B, Hi, C, topk]
        # 4. attention over the selected blocks this device holds, with the partial LSE
        mine = (sel >= 0) & (sel % n == me)
        lidx = jnp.where(mine, sel // n, 0)
        kb = jnp.moveaxis(k.reshape(b, nb_loc, block_size, kh, h), 3, 1)  # [B, K, nb, bs, H]
        vb = jnp.moveaxis(v.reshape(b, nb_loc, block_size, kh, h), 3, 1)
        bi = jnp.arange(b)[:, None, None, None]
        gi_ = jnp.arange(kh)[None, :, None, None]
        kg, vg = kb[bi, gi_, lidx], vb[bi, gi_, lidx]  # [B, K, C, topk, bs, H]
        g = nh // kh
        qg = q.reshape(b, c, kh, g, h)
        logits = jnp.einsum("bckgh,bkctsh->bkgcts", qg.astype(jnp.float32), kg.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * (h**-0.5)
        pos = sel[..., None] * block_size + jnp.arange(block_size)
        ok = mine[..., None] & (pos <= q_pos[:, None, :, None, None])
        logits = jnp.where(ok[:, :, None], logits, neg).reshape(b, kh, g, c, -1)
        m_loc = jnp.max(logits, -1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m_loc), m_loc, 0.0)
        p = jnp.exp(logits - m_safe)
        l_loc = p.sum(-1, keepdims=True)
        o_loc = jnp.einsum("bkgcx,bkcxh->bkgch", p, vg.reshape(b, kh, c, -1, h).astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
        lse = jnp.where(l_loc > 0, m_safe + jnp.log(jnp.where(l_loc > 0, l_loc, 1.0)), neg)  # [B, K, G, C, 1]
        # 5. merge the partials by LSE
        m_all = jax.lax.pmax(lse, axis)
        wgt = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m_all), 0.0)
        num = jax.lax.psum(o_loc / jnp.where(l_loc > 0, l_loc, 1.0) * wgt, axis)
        den = jax.lax.psum(wgt, axis)
        out = num / den  # [B, K, G, C, H]
        return jnp.moveaxis(out, 3, 1).reshape(b, c, nh, h).astype(q.dtype), sel

    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(P(), P(), P(axis), P(axis), P(axis), P()),
        out_specs=(P(), P()), check_vma=False,
    )(q, iq, k_local, v_local, ik_local, q_pos)


def split_context(x: jax.Array, n: int, block_size: int) -> jax.Array:
    """[B, S, ...] -> [n, B, S/n, ...]: block j to device j % n (the layout of the striped cache)."""
    b, s = x.shape[:2]
    nb = s // block_size
    x = x.reshape(b, nb // n, n, block_size, *x.shape[2:])
    return jnp.moveaxis(x, 2, 0).reshape(n, b, s // n, *x.shape[4:])


def msa_pallas_split_reason(cfg: M3Config | object, n: int) -> str | None:
    """Why the MSA kernels cannot run head-split over ``n`` devices (None when they can).

    Each device gets N / n query heads: whole KV groups when n divides K (K / n groups each, KV and
    index heads split with them), or N / n heads of one group when K divides n (that group's KV head
    and index head only). The per-device head counts must pass ``model.pallas_unsupported_reason``
    (G' = min(G, N / n) a multiple of 8 for the packed wgmma rows).
    """
    from m3jax.model import pallas_unsupported_reason

    t = getattr(cfg, "text", cfg)
    nh, kh, hi = t.num_attention_heads, t.num_key_value_heads, t.index_n_heads
    if hi != kh:
        return f"index heads {hi} != KV heads {kh} (the selection is per KV group)"
    if nh % n:
        return f"{nh} query heads do not split over {n} devices"
    if kh % n and n % kh:
        return f"{kh} KV groups do not split over {n} devices, nor {n} devices over them"
    per = nh // n
    groups = max(1, kh // n)
    local = dataclasses.replace(t, num_attention_heads=per, num_key_value_heads=groups, index_n_heads=groups)
    reason = pallas_unsupported_reason(local)
    return None if reason is None else f"{per} query heads per device: {reason}"


def msa_pallas_sharded(kernel: Callable, q, k, v, iq, ik, q_pos, cfg, *, mesh=None, axis: str = MODEL):
    """Run the MSA Pallas path ``kernel(q, k, v, iq, ik, q_pos, cfg) -> (o, block_idx)`` (the model's
    ``_msa_pallas``: index kernel + top-k + sparse attention) inside ``jax.shard_map`` over ``axis``.

    q [B, T, N, H], k/v [B, S, K, H], iq [B, T, K, Hx] (one index head per KV group), ik [B, S, Hx],
    q_pos [B, T]. Query heads are split over ``axis`` (out: [B, T, N, H] head-split, the layout ``wo``
    contracts). When n divides K, KV heads and index heads are split with them; when K divides n
    (M3: 4 KV heads on 8), K/V and iq enter replicated and each device slices its own group's KV head
    and index head, so the n / K devices of one group compute that group's selection redundantly
    (the index kernel is per (token, index head) row: every device gets the single-device selection,
    bit for bit). The shared index key ik and q_pos are replicated. The batch is split over ``data``
    when that axis divides it. Returns (o, block_idx int32 [B, K, T, topk]).

    No active mesh (and none given): ``kernel`` is called as is. When the per-device head counts do
    not fit the kernels (:func:`msa_pallas_split_reason`), every device runs the whole kernel on all
    heads (replicated, with a warning): correct, no memory or time saved.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or axis not in mesh.axis_names:
        return kernel(q, k, v, iq, ik, q_pos, cfg)
    n = mesh.shape[axis]
    nh, kh = q.shape[2], k.shape[2]
    b = q.shape[0]
    nd = mesh.shape.get(DATA, 1)
    bax = DATA if nd > 1 and b % nd == 0 else None
    rep = P(bax)
    reason = msa_pallas_split_reason(cfg, n)
    if reason is not None:
        warnings.warn(f"MSA Pallas kernels replicated over the {n}-device {axis!r} axis: {reason}", stacklevel=2)
        return jax.shard_map(lambda *a: kernel(*a, cfg), mesh=mesh, in_specs=(rep,) * 6, out_specs=(rep, rep),
                             check_vma=False)(q, k, v, iq, ik, q_pos)
    split_kv = kh % n == 0
    g = nh // kh

    def body(q_, k_, v_, iq_, ik_, qp_):
        if not split_kv:  # n / K devices per group: this device's group (KV head + index head)
            grp = jax.lax.axis_index(axis) * (nh // n) // g
            k_, v_, iq_ = (jax.lax.dynamic_slice_in_dim(x, grp, 1, axis=2) for x in (k_, v_, iq_))
        return kernel(q_, k_, v_, iq_, ik_, qp_, cfg)

    heads = P(bax, None, axis)
    kv = heads if split_kv else rep
    o, sel = jax.shard_map(
        body, mesh=mesh, in_specs=(heads, kv, kv, kv, rep, rep), out_specs=(heads, P(bax, axis)), check_vma=False,
    )(q, k, v, iq, ik, q_pos)
    return o, (sel if split_kv else sel[:, :: n // kh])  # one row per group (the n / K copies are equal)
