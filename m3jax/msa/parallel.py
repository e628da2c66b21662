"""MSA over a device mesh: one head-split wrapper (:func:`head_split`) and one context-parallel
skeleton (:func:`context_parallel`), each taking the per-device computation as a function.

docs/SHARDING.md has the strategy for MiniMax-M3 on 8 GPUs. The mesh axes are
:mod:`m3jax.mesh_axes`'; everything here is an explicit ``jax.shard_map`` region. Which of the two
runs, and with which per-device pieces, is :mod:`m3jax.msa.layer`'s choice.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from m3jax.cache import LayerCache
from m3jax.config import M3Config
from m3jax.mesh_axes import DATA, MODEL, ShardingRuleError
from m3jax.msa import reference
from m3jax.msa.reference import forced_out, forced_priority, lse_merge, rank_scores


def global_topk(scores, gid, q_pos, n: int, *, block_size: int, topk: int, local_blocks: int, init_blocks: int,
                 axis: str, force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = ()) -> jax.Array:
    """The single-device block selection from each device's scores of its own blocks (inside ``shard_map``).

    scores fp32 [B, Hi, C, nb_loc] (-inf where no key is visible) of the local blocks whose global ids
    are ``gid`` [nb_loc]. Each device ranks its blocks as :func:`m3jax.msa.reference.select_blocks`
    does (forced own / local / sink blocks first, by global id), keeps its top-k, all-gathers the n * k
    (score, id) candidates, and takes the global top-k with ties to the lower block id (candidates
    sorted by id before ``top_k``). Returns int32 [B, Hi, C, topk], -1 padded, equal on every device.
    """
    own = (q_pos // block_size)[:, None, :, None]
    j = gid[None, None, None, :]
    prio = forced_priority(own - j, j, local_blocks=local_blocks, init_blocks=init_blocks, force_in=force_in)
    ranked = rank_scores(forced_out(scores, own - j, j, force_out), prio)
    vals, li = jax.lax.top_k(ranked, min(topk, scores.shape[-1]))
    ids = gid[li]
    all_vals = jnp.moveaxis(jax.lax.all_gather(vals, axis), 0, -2).reshape(*vals.shape[:3], -1)
    all_ids = jnp.moveaxis(jax.lax.all_gather(ids, axis), 0, -2).reshape(*ids.shape[:3], -1)
    order = jnp.argsort(all_ids, axis=-1)
    all_vals = jnp.take_along_axis(all_vals, order, -1)
    all_ids = jnp.take_along_axis(all_ids, order, -1)
    if all_vals.shape[-1] < topk:  # fewer blocks than k in the whole context: pad with empty slots
        pad = [(0, 0)] * 3 + [(0, topk - all_vals.shape[-1])]
        all_vals, all_ids = jnp.pad(all_vals, pad, constant_values=-jnp.inf), jnp.pad(all_ids, pad)
    gv, gi = jax.lax.top_k(all_vals, topk)
    return jnp.where(gv == -jnp.inf, -1, jnp.take_along_axis(all_ids, gi, -1)).astype(jnp.int32)


def head_split_reason(cfg: M3Config | object, n: int, unsupported_reason: Callable) -> str | None:
    """Why an MSA kernel cannot run head-split over ``n`` devices (None when it can).

    Each device gets N / n query heads: whole KV groups when n divides K (K / n groups each, KV and
    index heads split with them), or N / n heads of one group when K divides n (that group's KV head
    and index head only). The per-device head counts (G' = min(G, N / n) query heads per group) must
    pass ``unsupported_reason(local_cfg)`` (the kernels': :func:`m3jax.msa.kernels.unsupported_reason`).
    """
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
    reason = unsupported_reason(local)
    return None if reason is None else f"{per} query heads per device: {reason}"


def head_split(kernel: Callable, q, k, v, iq, ik, q_pos, cfg, *, unsupported_reason: Callable, mesh=None,
               axis: str = MODEL):
    """Run an MSA kernel ``kernel(q, k, v, iq, ik, q_pos, cfg) -> (o, block_idx)`` over contiguous keys
    (:func:`m3jax.msa.kernels.prefill`: index kernel + top-k + sparse attention) inside
    ``jax.shard_map`` over ``axis``.

    q [B, T, N, H], k/v [B, S, K, H], iq [B, T, K, Hx] (one index head per KV group), ik [B, S, Hx],
    q_pos [B, T]. Query heads are split over ``axis`` (out: [B, T, N, H] head-split, the layout ``wo``
    contracts). When n divides K, KV heads and index heads are split with them; when K divides n
    (M3: 4 KV heads on 8), K/V and iq enter replicated and each device slices its own group's KV head
    and index head, so the n / K devices of one group compute that group's selection redundantly
    (the index kernel is per (token, index head) row: every device gets the single-device selection,
    bit for bit). The shared index key ik and q_pos are replicated. The batch is split over ``data``
    when that axis divides it. Returns (o, block_idx int32 [B, K, T, topk]).

    No active mesh (and none given): ``kernel`` is called as is. When the per-device head counts do
    not fit the kernel (:func:`head_split_reason` with ``unsupported_reason``), every device runs the
    whole kernel on all heads (replicated, with a warning): correct, no memory or time saved.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or axis not in mesh.axis_names:
        return kernel(q, k, v, iq, ik, q_pos, cfg)
    n = mesh.shape[axis]
    nh, kh = q.shape[2], k.shape[2]
    bax = batch_axis(mesh, q.shape[0])
    rep = P(bax)
    reason = head_split_reason(cfg, n, unsupported_reason)
    if reason is not None:
        warnings.warn(f"MSA kernels replicated over the {n}-device {axis!r} axis: {reason}", stacklevel=2)
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


def context_split_reason(kv: LayerCache, n: int, *, index: bool = True) -> str | None:
    """Why attention over the paged cache ``kv`` cannot run context parallel over ``n`` devices (None
    when it can): the pages must split evenly (the striped cache of
    :func:`m3jax.sharding.init_sharded_cache`), and MSA needs its index-key pages (``index``)."""
    if index and kv.ik is None:
        return "no index-key pages (not an MSA layer)"
    if kv.k.shape[0] % n:
        return f"{kv.k.shape[0]} cache pages do not split over {n} devices (use m3jax.sharding.init_sharded_cache)"
    return None


def axis_size(mesh, axis: str) -> int:
    """Size of ``axis`` in ``mesh`` (default: the active one); 1 when there is none."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis]


def batch_axis(mesh, batch: int) -> str | None:
    """The mesh axis a batch of ``batch`` sequences splits over inside these shard_maps: ``data`` when it
    is > 1 and divides the batch, else none (each data replica then computes every sequence)."""
    nd = mesh.shape.get(DATA, 1)
    return DATA if nd > 1 and batch % nd == 0 else None


def _pad_window(page_table: jax.Array, n: int) -> tuple[jax.Array, int]:
    """The page table padded to a multiple of n logical blocks (the pad lies beyond every query, so
    nothing reads it), and the blocks per device."""
    w = page_table.shape[1]
    nb_loc = -(-w // n)
    return jnp.pad(page_table, [(0, 0), (0, nb_loc * n - w)]), nb_loc


def _local_pages(page_table: jax.Array, me, n: int, per: int) -> jax.Array:
    """Device ``me``'s page table: on the striped cache logical block j' * n + me is its local block j',
    at local page ``page_table[:, j' * n + me] - me * per`` (per = pages per device)."""
    b, w = page_table.shape
    return jnp.clip(page_table.reshape(b, w // n, n)[:, :, me] - me * per, 0, per - 1)


def _local_length(pos: jax.Array, me, n: int, block_size: int) -> jax.Array:
    """Keys of device ``me``'s blocks that a query at ``pos`` sees: its local blocks before the query's
    own block whole, and the own block (on device own % n) up to ``pos``. In the device's contiguous
    local key order these are exactly keys 0 .. length-1, so a kernel's causal mask with this length
    (or local query position length - 1) is the global causal mask."""
    own = pos // block_size
    whole = jnp.maximum(own - me + n - 1, 0) // n
    return whole * block_size + jnp.where(own % n == me, pos % block_size + 1, 0)


def prefill_context_parallel(cfg, n: int, *, queries: int, window_tokens: int, q_bytes: int, kv_bytes: int) -> bool:
    """The rule between the two ways an MSA prefill chunk runs over the page-split cache on ``n`` devices.

    Context parallel (:func:`context_parallel`) moves the chunk's queries to the keys: every device
    receives all query heads (q all-gathered, ``queries * N * H`` values) and the fp32 partial outputs
    are all-reduced by the LSE merge (``queries * N * H * 4`` bytes, twice over the ring). Head-split over
    a gathered window (:func:`head_split`; the XLA-partitioned reference) moves the keys to the
    queries: every device receives the window's K, V and index keys. Compute never favours the
    gathered window (context parallel scores each key once over all devices; head split scores it on
    n / K devices when K < n, twice for M3 on 8) and neither does memory (a gathered window per device
    against 1/n of it), so the traffic decides: context parallel once the window's keys outweigh the
    queries. For M3 in BF16 that is a window of >= 35.6 x the chunk (>= 292K tokens at 8192-token chunks):
    the early chunks of a long prompt stay head-split, where the query exchange would cost more than
    the window it avoids gathering."""
    t = getattr(cfg, "text", cfg)
    gathered = window_tokens * (2 * t.num_key_value_heads * t.head_dim + t.index_head_dim) * kv_bytes
    exchanged = queries * t.num_attention_heads * t.head_dim * (q_bytes + 2 * 4)
    return n > 1 and gathered >= exchanged




class Local(NamedTuple):
    """The per-device pieces of :func:`context_parallel`, for one way of computing MSA.

    - ``keys(k_pages, v_pages, ik_pages, local_pages)``: this device's keys as the other two read
      them (e.g. :func:`local_window`, or the pages and local page table as they are), once per step.
      ``ik_pages`` is None without ``scores``.
    - ``scores(iq [B, C, Hi, Hx], keys, local_len [B, C])``: fp32 block scores [B, Hi, C, nb_loc] of
      the local blocks, ``local_len`` the local keys each query sees (:func:`_local_length`); rows with
      none are set to -inf here. None: no selection (full attention over every visible block).
    - ``attend(q [B, C, N, H], keys, local_sel [B, K, C, k], local_len)``: attention over the local
      blocks ``local_sel`` (-1 padded) and its natural-log LSE: (o [B, C, N, H], lse fp32 [B, C, N]).
    - ``query_chunk``: run ``scores`` / ``attend`` in query chunks of this many (None: the whole chunk).
    """

    keys: Callable
    scores: Callable | None
    attend: Callable
    query_chunk: int | None = None


def local_window(k_pages, v_pages, ik_pages, local_pages):
    """This device's pages of the window as contiguous copies (W / n blocks; nothing crosses devices):
    (k, v [B, S_loc, K, H], ik [B, S_loc, Hx] or None) in local key order."""
    b, nb_loc = local_pages.shape

    def window(pages):
        return None if pages is None else pages[local_pages].reshape(b, nb_loc * pages.shape[1], *pages.shape[2:])

    return window(k_pages), window(v_pages), window(ik_pages)


def context_parallel(local: Local, q, iq, kv: LayerCache, page_table, q_pos, cfg, *, force_in=(), force_out=(),
                     mesh=None, axis: str = MODEL):
    """Attention of a query chunk over the page-striped cache, context parallel over ``axis``
    (docs/SHARDING.md): MSA prefill or decode, or full attention (``local.scores`` None).

    q [B, C, N, H] and iq [B, C, Hi, Hx] (None for full attention) at q_pos [B, C] (all heads on
    every device; the batch split over ``data`` where :func:`batch_axis` says so); ``kv`` the layer's
    pages as :func:`m3jax.sharding.init_sharded_cache` splits them (device d holds pages
    [d * P/n, (d + 1) * P/n) and logical block j of every sequence lives on device j % n, so device d's
    blocks j' * n + d form a local page table ``page_table[:, d::n] - d * P/n``); page_table [B, W] the
    chunk's key window (the new keys already written). Per device: ``local.keys`` of its own pages;
    ``local.scores`` of its blocks with the local causal length (the local blocks below a query's own
    block are whole, the own block, on device own % n, is cut at the query); local top-k ranked by
    global block id and the global top-k of all devices' candidates (:func:`global_topk`: the
    single-device selection); ``local.attend`` over the selected blocks this device holds, with its
    LSE; :func:`m3jax.msa.reference.lse_merge` of the n partials. Only the [B, Hi, C, n * topk]
    candidates and the partial outputs cross devices; the cache is never gathered.

    Returns (o [B, C, N, H] in q.dtype, the same on every device of ``axis``; block ids int32
    [B, Hi, C, topk] in select_blocks' order), or o alone for full attention.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    n = mesh.shape[axis]
    t = getattr(cfg, "text", cfg)
    bs = t.index_block_size
    per = kv.k.shape[0] // n
    page_table, nb_loc = _pad_window(page_table, n)
    select = local.scores is not None
    kh = kv.k.shape[2]

    def attend(qp, keys, me, q_, iq_=None):
        local_len = _local_length(qp, me, n, bs)  # [B, C]
        if select:
            scores = local.scores(iq_, keys, local_len)
            # a query that sees no local key scores -inf everywhere (a kernel may leave such rows unwritten)
            scores = jnp.where(local_len[:, None, :, None] > 0, scores, -jnp.inf)
            gid = jnp.arange(nb_loc) * n + me  # global block id of each local block
            sel = global_topk(scores, gid, qp, n, block_size=bs, topk=t.index_topk_blocks,
                               local_blocks=t.index_local_blocks, init_blocks=t.index_init_blocks, axis=axis,
                               force_in=force_in, force_out=force_out)
            local_sel = jnp.where((sel >= 0) & (sel % n == me), sel // n, -1)
        else:  # every local block with a visible key
            blocks = jnp.arange(nb_loc, dtype=jnp.int32)
            local_sel = jnp.where(blocks * bs < local_len[..., None], blocks, -1)  # [B, C, nb_loc]
            local_sel = jnp.broadcast_to(local_sel[:, None], (q_.shape[0], kh) + local_sel.shape[1:])
        o, lse = local.attend(q_, keys, local_sel, local_len)
        o, _ = lse_merge(o, lse, axis_name=axis)
        return (o.astype(q_.dtype), sel) if select else o.astype(q_.dtype)

    def body(qs, pages, pt_, qp_):
        me = jax.lax.axis_index(axis)
        k_, v_, *ik_ = pages
        keys = local.keys(k_, v_, ik_[0] if ik_ else None, _local_pages(pt_, me, n, per))
        chunk = local.query_chunk
        if chunk is None or chunk >= qs[0].shape[1]:
            return attend(qp_, keys, me, *qs)
        out, merge = reference.map_query_chunks(lambda qp, *qc: attend(qp, keys, me, *qc), chunk, qp_, *qs)
        return (merge(out[0], 1), merge(out[1], 2)) if select else merge(out, 1)

    rows = P(batch_axis(mesh, q.shape[0]))
    qs = (q, iq) if select else (q,)
    pages = (kv.k, kv.v, kv.ik) if select else (kv.k, kv.v)
    return jax.shard_map(
        body, mesh=mesh, in_specs=((rows,) * len(qs), (P(axis),) * len(pages), rows, rows),
        out_specs=(rows, rows) if select else rows, check_vma=False,
    )(qs, pages, page_table, q_pos)
