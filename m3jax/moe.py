"""MoE block of MiniMax-M3 (docs/ARCHITECTURE.md §1.5): sigmoid router with a selection-only correction bias,
top-k renormalised weights, SwiGLU-OAI experts, routed scaling, one shared expert.

Two equal implementations: :func:`moe_sorted` (tokens sorted by expert + grouped matmul, the
production shape) and :func:`moe_dense_reference` (every expert on every token, masked; readable
and only viable for tiny configs).

MXFP8 weights (``load_pretrained(..., weights="mxfp8")``, :class:`m3jax.layers.MXFP8Weight`): the
routed experts stay fp8 + scales into the grouped GEMM, whose kernel dequantises each tile
(``grouped_matmul_mxfp8``), so a step reads them as fp8 whatever XLA fuses. The model's other MXFP8
matmuls (the shared expert, the dense layers' MLP, the attention and index projections) go through
:func:`linear`: the same kernel with one group at decode row counts, dequantised inside jit
(:func:`m3jax.layers.dequantize`) otherwise, on the ``ragged_dot`` path and under tensor parallelism.
Weights of one shape that multiply the same rows (an MLP's gate and up, attention's k and v) go as one
kernel launch at decode: :func:`grouped_matmuls`, :func:`linears`; the shared expert's GEMMs share the
routed experts' launches there (:func:`expert_mlps`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.config import TextConfig
from m3jax.layers import MXFP8Weight, dequantize, dequantize_tree, dot_precision, swiglu_oai
from m3jax.mesh_axes import MODEL
from m3jax.pallas import _backend, grouped_matmul as gmm
from m3jax.pallas.grouped_matmul import gemv
from m3jax.pallas.verdicts import kernel_failure


def dequantize_layer(lp: dict, dtype) -> dict:
    """A decoder layer's MXFP8 weights dequantised to ``dtype`` for code that reads them as arrays (an
    attention hook), the MoE block's kept MXFP8 for the grouped GEMM and :func:`linear`."""
    return dequantize_tree(lp, dtype, keep=lambda path: path[0].key == "moe")


# Dense MXFP8 matmuls take the grouped-GEMM kernel (one group) up to this many rows: at decode it reads
# the fp8 weights once where XLA would dequantise them into a temporary first; past it XLA's single
# dequantising pass per call is small beside a GEMM of that many rows, and the kernel's in-tile
# conversion measured slower there (benchmarks/RESULTS.md#mxfp8-dense-rows).
# TODO(measure): whether the faster prefill MXFP8 tiles now beat dequantise-then-dot past 64 rows.
MXFP8_KERNEL_MAX_ROWS = 64


def linear(x: jax.Array, w: jax.Array | MXFP8Weight, impl: str = "ragged_dot", in_axes: int = 1) -> jax.Array:
    """``x [..., *in] @ w [*in, *out] -> [..., *out]``, contracting x's last ``in_axes`` axes with w's first.

    An MXFP8 ``w`` runs the MXFP8 grouped GEMM with one group (every row) when :func:`_dense_kernel_config`
    takes it for ``impl`` ("auto": on the GPU; "pallas": also in interpret mode off it) and these rows;
    otherwise it is dequantised to ``x.dtype`` at use. Either way the product is that of the dequantised
    weight, up to accumulation order."""
    return linears(x, (w,), impl, in_axes)[0]


def _one_mxfp8_shape(ws) -> bool:
    """Whether every weight of ``ws`` is MXFP8 with the same values and scales shapes: one kernel launch can
    take them together (``grouped_matmuls_mxfp8``)."""
    return all(isinstance(w, MXFP8Weight) for w in ws) and len({(w.values.shape, w.scales.shape) for w in ws}) == 1


def linears(x: jax.Array, ws, impl: str = "ragged_dot", in_axes: int = 1, dense_gemv: bool = False) -> tuple:
    """:func:`linear` of one ``x`` with each weight of ``ws``; MXFP8 weights of one shape that the kernel
    takes run as one launch (``grouped_matmuls_mxfp8``: an MLP's gate and up, attention's k and v).
    Weights of several shapes: the MXFP8 ones of each shape as such a launch; with ``dense_gemv`` the bf16
    ones the dense gemv takes at these rows (:func:`_dense_gemv_takes`: decode) as one launch of it
    whatever their widths (a decode step's attention projections); the rest as XLA dots."""
    if not _one_mxfp8_shape(ws):
        out = [None] * len(ws)
        batches = {}
        for i, w in enumerate(ws):
            if isinstance(w, MXFP8Weight):
                batches.setdefault((w.values.shape, w.scales.shape), []).append(i)
        for idx in batches.values():
            for i, y in zip(idx, linears(x, tuple(ws[i] for i in idx), impl, in_axes)):
                out[i] = y
        if take := (_dense_gemv_takes(x, ws, impl, in_axes) if dense_gemv else []):
            k = math.prod(x.shape[x.ndim - in_axes:])
            done = gmm.dense_gemvs(x.reshape(-1, k), [ws[i].reshape(k, -1) for i in take])
            for i, y in zip(take, done):
                out[i] = y.reshape(*x.shape[: x.ndim - in_axes], *ws[i].shape[in_axes:])
        return tuple(jnp.tensordot(x, w, axes=in_axes, precision=dot_precision(x.dtype)) if y is None else y
                     for y, w in zip(out, ws))
    for w in ws:
        if w.group_axis != in_axes - 1:
            raise ValueError(f"MXFP8 weight {w.values.shape} groups axis {w.group_axis}, not its last input axis "
                             f"({in_axes - 1} with in_axes={in_axes})")
    in_shape, out_shape = ws[0].values.shape[:in_axes], ws[0].values.shape[in_axes:]
    k, n = math.prod(in_shape), math.prod(out_shape)
    rows = x.reshape(-1, k)
    # one group of [k, n]: the scales' groups stay 32 consecutive inputs of the flattened input axes
    ones = [(w.values.reshape(1, k, n), w.scales.reshape(1, -1, n)) for w in ws]
    config = _dense_kernel_config(impl, rows, MXFP8Weight(*ones[0]), len(ws))
    if config is None:
        return tuple(jnp.tensordot(x, dequantize(w, x.dtype), axes=in_axes, precision=dot_precision(x.dtype))
                     for w in ws)
    sizes = np.full((1,), rows.shape[0], np.int32)  # known when tracing: the kernel's schedule is a constant
    outs = gmm.grouped_matmuls_mxfp8(rows, ones, sizes, config=config)
    return tuple(out.reshape(*x.shape[: x.ndim - in_axes], *out_shape) for out in outs)


# The bf16 dense gemv runs a decode step's projections where it beat XLA's dots (H100,
# benchmarks/RESULTS.md#dense-gemv): one row, narrow weights (k, v and the index q at 512 columns: XLA runs
# each as a split-K pair of launches). At 8 rows, and for q's 8,192 columns at one, XLA was faster.
DENSE_GEMV_ROWS = 1
DENSE_GEMV_MAX_N = 1024


def _dense_gemv_takes(x: jax.Array, ws, impl: str, in_axes: int) -> list[int]:
    """The indices of ``ws`` that :func:`linears` runs on the bf16 dense gemv (``gmm.dense_gemvs``): bf16
    rows and weights, at most DENSE_GEMV_ROWS rows and DENSE_GEMV_MAX_N columns, shapes it takes, ``impl``
    "auto" on the GPU or "pallas", no tensor-parallel mesh, a kernel that passed its canary. Where it takes
    none, XLA's dots."""
    k = math.prod(x.shape[x.ndim - in_axes:])
    m = x.size // max(k, 1)
    if (impl == "ragged_dot" or (impl == "auto" and not _backend.on_gpu()) or x.dtype != jnp.bfloat16
            or m > DENSE_GEMV_ROWS):
        return []
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and dict(mesh.shape).get(MODEL, 1) > 1:
        return []
    take = [i for i, w in enumerate(ws) if not isinstance(w, MXFP8Weight) and w.size // k <= DENSE_GEMV_MAX_N
            and gmm.dense_gemv_unsupported_reason(m, k, w.size // k, w.dtype) is None]
    return take if take and kernel_failure("grouped_matmul") is None else []


def _dense_kernel_config(impl: str, rows: jax.Array, one: MXFP8Weight, weights: int = 1):
    """The kernel config :func:`linears` runs ``rows [m, k] x one [1, k, n]`` with (``weights`` of that shape in
    one launch), or None for XLA: ``impl``
    "auto" on the GPU or "pallas", at most MXFP8_KERNEL_MAX_ROWS rows, a shape the kernel takes, no
    tensor-parallel mesh (the weight would be gathered to every device for the custom call), a kernel
    that passed its canary. Shapes it cannot take are dequantised quietly, even for "pallas": that forces
    the MoE's kernel."""
    m, k = rows.shape
    if impl == "ragged_dot" or m > MXFP8_KERNEL_MAX_ROWS:
        return None
    if impl == "auto" and not _backend.on_gpu():
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and dict(mesh.shape).get(MODEL, 1) > 1:
        return None
    config = _grouped_matmul_config(m, one, weights)
    if gmm.mxfp8_unsupported_reason(m, k, one.values.shape[2], 1, one.scales.shape[1], config) is not None:
        return None
    return config if kernel_failure("grouped_matmul") is None else None


def dense_mlp(x: jax.Array, p: dict, cfg: TextConfig, impl: str = "ragged_dot") -> jax.Array:
    """SwiGLU-OAI MLP. x: [..., D]; p: gate/up [D, F], down [F, D]. MXFP8 weights: :func:`linear`."""
    gate, up = linears(x, (p["gate"], p["up"]), impl)
    act = swiglu_oai(gate, up, cfg.swiglu_alpha, cfg.swiglu_limit)
    return linear(act.astype(x.dtype), p["down"], impl)


def route(x: jax.Array, p: dict, cfg: TextConfig, shared_slot: bool = False) -> tuple[jax.Array, jax.Array]:
    """Router. x: [T, D] -> (expert ids int32 [T, k], weights fp32 [T, k]).

    Logits and sigmoid in fp32; the correction bias only decides the choice; the weights are the
    unbiased scores of the chosen experts renormalised to sum to 1. ``shared_slot``: [T, k + 1], slot 0
    the shared expert as id E with weight 0, the chosen experts after it in their order (a decode token's
    grouped GEMM ids, from the choice's own fusion).
    """
    logits = jnp.dot(x.astype(jnp.float32), p["router"], precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    biased, k = scores + p["router_bias"], cfg.num_experts_per_tok
    if shared_slot:  # an extra expert E that every token ranks first, of score 0
        biased = jnp.pad(biased, ((0, 0), (0, 1)), constant_values=jnp.inf)
        scores, k = jnp.pad(scores, ((0, 0), (0, 1))), k + 1
    ids, w = choose_experts(biased, scores, k)
    routed = w[:, 1:] if shared_slot else w  # normalised alone: the same sums as without the slot
    routed = routed / jnp.sum(routed, axis=-1, keepdims=True)
    return ids, jnp.pad(routed, ((0, 0), (1, 0))) if shared_slot else routed


def choose_experts(biased: jax.Array, scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(ids int32 [T, k], ``scores`` at them [T, k]): ``jax.lax.top_k(biased, k)``'s experts in its order
    (descending, the lower id first among equals). Up to :data:`FEW_PAIRS` (token, slot) pairs by ranks:
    expert i's rank is the number of experts before it in that order, all pairs compared at once, a
    fusion or two where top-k is a sort launch and the scores' gather another (a decode step;
    benchmarks/RESULTS.md#row-visits)."""
    t, e = biased.shape
    if t * k > FEW_PAIRS:
        _, ids = jax.lax.top_k(biased, k)
        return ids.astype(jnp.int32), jnp.take_along_axis(scores, ids, axis=-1)
    i = jnp.arange(e, dtype=jnp.int32)
    a, b = biased[:, :, None], biased[:, None, :]  # [t, i, j]
    rank = jnp.sum((b > a) | ((b == a) & (i[None, None, :] < i[None, :, None])), axis=2, dtype=jnp.int32)
    slot = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [t, slot, i]: one i per slot
    ids = jnp.sum(jnp.where(slot, i, 0), axis=2, dtype=jnp.int32)
    return ids, jnp.sum(jnp.where(slot, scores[:, None, :], 0), axis=2)


def _grouped_matmul_config(m: int, w: jax.Array | MXFP8Weight, weights: int = 1):
    """The kernel config for ``m`` rows times ``w [E, K, N]`` (tiles and schedule per regime; ``weights`` of
    that shape in one launch)."""
    mx = isinstance(w, MXFP8Weight)
    g, k, n = (w.values if mx else w).shape
    return gmm.layer_config(m, k, n, g, w.scales.shape[1] if mx else None, weights)


_FALLBACK_WARNED: set[str] = set()


def resolve_moe_impl(impl: str, xs: jax.Array, w: jax.Array | MXFP8Weight) -> str:
    """"ragged_dot" or "pallas" for ``xs [M, K] x w [E, K, N]`` (``w`` may be MXFP8: the MXFP8 kernel's limits).

    "auto" takes the Mosaic GPU grouped-matmul kernel on GPU for shapes it supports, bf16 or fp32
    (fp32 split into three bf16 pieces: fp32-exact; ``jax.lax.ragged_dot`` is dense-emulated on the
    device image's cuDNN), else ``jax.lax.ragged_dot`` with one warning per reason; off the GPU
    ``jax.lax.ragged_dot``. An explicit "pallas" raises on shapes the kernel cannot take (off-GPU it
    runs in interpret mode: tests only).
    """
    if impl == "ragged_dot":
        return impl
    if impl not in ("auto", "pallas"):
        raise ValueError(f"moe_impl={impl!r}; choose 'auto', 'ragged_dot' or 'pallas'")

    if isinstance(w, MXFP8Weight):
        (m, k), (g, _, n) = xs.shape, w.values.shape
        reason = gmm.mxfp8_unsupported_reason(m, k, n, g, w.scales.shape[1], _grouped_matmul_config(m, w))
    else:
        (m, k), (g, _, n) = xs.shape, w.shape
        reason = gmm.unsupported_reason(m, k, n, g, _grouped_matmul_config(m, w))
    shape_reason = reason
    if reason is None:  # a kernel that fails its canary on this GPU is not used (m3jax.pallas.verdicts, which warns)
        reason = kernel_failure("grouped_matmul")
    if impl == "pallas":
        if reason:
            raise ValueError(f"moe_impl='pallas' cannot run [{m}, {k}] x [{g}, {k}, {n}]: {reason}")
        return impl
    if not _backend.on_gpu():
        return "ragged_dot"
    if shape_reason is not None and shape_reason not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(shape_reason)
        warnings.warn(f"moe_impl='auto': the grouped-matmul kernel cannot run [{m}, {k}] x [{g}, {k}, {n}] "
                      f"({shape_reason}); using jax.lax.ragged_dot", RuntimeWarning, stacklevel=3)
    return "pallas" if reason is None else "ragged_dot"


def grouped_matmul(xs: jax.Array, w: jax.Array | MXFP8Weight, group_sizes: jax.Array, impl: str = "auto") -> jax.Array:
    """``jax.lax.ragged_dot(xs [M, K], w [E, K, N], group_sizes [E])`` through the chosen implementation;
    MXFP8 ``w``: the MXFP8 kernel, or ragged_dot over the weights dequantised to ``xs.dtype``."""
    use_kernel = resolve_moe_impl(impl, xs, w) == "pallas"
    if isinstance(w, MXFP8Weight):
        if use_kernel:
            config = _grouped_matmul_config(xs.shape[0], w)
            return gmm.grouped_matmul_mxfp8(xs, w.values, w.scales, group_sizes, config=config)
        w = dequantize(w, xs.dtype)
    if use_kernel:
        return gmm.grouped_matmul(xs, w, group_sizes, config=_grouped_matmul_config(xs.shape[0], w))
    return jax.lax.ragged_dot(xs, w, group_sizes, precision=dot_precision(xs.dtype))


def grouped_matmuls(xs: jax.Array, ws, group_sizes: jax.Array, impl: str = "auto") -> tuple:
    """:func:`grouped_matmul` of one ``xs`` with each weight of ``ws``; MXFP8 weights of one shape on the
    kernel run as one launch where their schedule allows (``grouped_matmuls_mxfp8``: the gemv at decode)."""
    w0 = ws[0]
    if _one_mxfp8_shape(ws) and resolve_moe_impl(impl, xs, w0) == "pallas":
        return gmm.grouped_matmuls_mxfp8(xs, [(w.values, w.scales) for w in ws], group_sizes,
                                     config=_grouped_matmul_config(xs.shape[0], w0, len(ws)))
    return tuple(grouped_matmul(xs, w, group_sizes, impl) for w in ws)


def grouped_expert_mlp(xs: jax.Array, group_sizes: jax.Array, p: dict, cfg: TextConfig,
                       impl: str = "auto") -> jax.Array:
    """Expert MLPs over rows already sorted by expert. xs: [M, D]; group_sizes: int32 [E].

    ``impl``: ``M3Config.moe_impl`` ("auto" | "ragged_dot" | "pallas"), per matmul (see
    :func:`resolve_moe_impl`).
    """
    gate, up = grouped_matmuls(xs, (p["gate"], p["up"]), group_sizes, impl)
    act = swiglu_oai(gate, up, cfg.swiglu_alpha, cfg.swiglu_limit).astype(xs.dtype)
    return grouped_matmul(act, p["down"], group_sizes, impl)


def expert_mlps(xs: jax.Array, group_sizes: jax.Array, x: jax.Array, p: dict, cfg: TextConfig,
                impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """(routed experts' MLPs over the sorted rows ``xs [M, D]``, shared expert's over ``x [T, D]``).

    Where every projection is MXFP8 and would run the gemv schedule (decode rows, on the kernel), the
    routed and shared GEMMs of each stage share a launch (``gemv_launch_mxfp8``: gate and up of both,
    then down of both): alone, the shared expert's launch of one group spends most of its time filling
    and draining its pipeline. At one token the shared expert's problem follows the routed one's at the
    K split it would run alone; at several it leads the launch at ``gemv.leading_split`` (its visits then
    run a body of several rows, bound by instruction issue: spread one CTA per SM beside the routed
    CTAs, not queued at the launch's end: benchmarks/RESULTS.md#shared-expert-leads). Otherwise
    :func:`grouped_expert_mlp` and :func:`dense_mlp`. The same kernel bodies either way."""
    plan = _gemv_configs(xs, x, p, impl)
    if plan is None:
        return grouped_expert_mlp(xs, group_sizes, p, cfg, impl), dense_mlp(x, p["shared"], cfg, impl)
    configs, lead = plan
    ps = p["shared"]
    one = np.full((1,), x.shape[0], np.int32)  # known when tracing: the shared expert's schedule is a constant

    def pair(w, shared=False):
        return (w.values[None], w.scales[None]) if shared else (w.values, w.scales)

    def launch(routed, shared):
        out = gmm.gemv_launch_mxfp8((shared, routed) if lead else (routed, shared))
        return out[::-1] if lead else out

    (gate, up), (s_gate, s_up) = launch(
        (xs, (pair(p["gate"]), pair(p["up"])), group_sizes, configs[0]),
        (x, (pair(ps["gate"], True), pair(ps["up"], True)), one, configs[1]))
    act = swiglu_oai(gate, up, cfg.swiglu_alpha, cfg.swiglu_limit).astype(xs.dtype)
    s_act = swiglu_oai(s_gate, s_up, cfg.swiglu_alpha, cfg.swiglu_limit).astype(x.dtype)
    (ys,), (shared,) = launch((act, (pair(p["down"]),), group_sizes, configs[2]),
                              (s_act, (pair(ps["down"], True),), one, configs[3]))
    return ys, shared


def _gemv_configs(xs: jax.Array, x: jax.Array, p: dict, impl: str):
    """(the gemv configs of (routed gate + up, shared gate + up, routed down, shared down), whether the
    shared expert leads the launches), or None unless every projection is MXFP8 on the gemv schedule
    (what :func:`grouped_matmuls` and :func:`linears` would run them with)."""
    ps = p["shared"]
    if x.ndim != 2 or not all(isinstance(q["gate"], MXFP8Weight) and _one_mxfp8_shape((q["gate"], q["up"]))
                              and isinstance(q["down"], MXFP8Weight) for q in (p, ps)):
        return None
    if any(w.group_axis != 0 for w in (ps["gate"], ps["up"], ps["down"])):
        return None
    m, t = xs.shape[0], x.shape[0]
    act = jax.ShapeDtypeStruct((m, p["down"].values.shape[1]), xs.dtype)
    for rows, w in ((xs, p["gate"]), (act, p["down"])):  # raises for "pallas" on a shape the kernel cannot take
        if resolve_moe_impl(impl, rows, w) != "pallas":
            return None
    s_act = jax.ShapeDtypeStruct((t, ps["down"].values.shape[0]), x.dtype)
    configs = (_grouped_matmul_config(m, p["gate"], 2),
               _dense_kernel_config(impl, x, MXFP8Weight(ps["gate"].values[None], ps["gate"].scales[None]), 2),
               _grouped_matmul_config(m, p["down"]),
               _dense_kernel_config(impl, s_act, MXFP8Weight(ps["down"].values[None], ps["down"].scales[None])))
    if any(c is None or c.schedule != "gemv" for c in configs):
        return None
    return _shared_leads(configs, t, ps)


def _shared_leads(configs: tuple, t: int, ps: dict) -> tuple[tuple, bool]:
    """(configs, whether the shared expert's problem leads each launch): it does at several tokens, at
    ``gemv.leading_split`` (see :func:`expert_mlps`); at one token it follows at the split it has alone."""
    if t == 1:
        return configs, False
    lead = [dataclasses.replace(c, split_k=gemv.leading_split(w.values.shape[0], w.values.shape[1], n))
            for c, w, n in ((configs[1], ps["gate"], 2), (configs[3], ps["down"], 1))]
    return (configs[0], lead[0], configs[2], lead[1]), True


def moe_sorted(x: jax.Array, p: dict, cfg: TextConfig, impl: str = "auto") -> jax.Array:
    """MoE over x [T, D] -> [T, D]: (token, slot) pairs sorted by expert, grouped matmul, weighted sum per
    token; one token on the kernels: its pairs in slot order, each a visit of its own (``gmm.RowGroups``).

    ``impl``: the grouped matmul (``M3Config.moe_impl``)."""
    if expert_parallel_axis(cfg) is not None:  # a mesh with an expert axis is active (m3jax.sharding)
        return moe_expert_parallel(x, p, cfg, impl=impl)
    t, d = x.shape
    k, e = cfg.num_experts_per_tok, cfg.num_local_experts
    if t == 1 and _row_visits(jax.ShapeDtypeStruct((k, d), x.dtype), p, impl):
        # one token's k experts are distinct: each (token, slot) row is a kernel visit of its own, in slot
        # order (gmm.RowGroups); no sort by expert, no group sizes, no schedule op: the kernels read the ids
        # (benchmarks/RESULTS.md#row-visits)
        if isinstance(p["gate"], MXFP8Weight):
            ids, w = route(x, p, cfg)
            ys, shared = expert_mlps(jnp.broadcast_to(x, (k, d)), gmm.RowGroups(ids[0]), x, p, cfg, impl)
        else:
            ys, shared, w = _token_mlps(x, p, cfg, impl)
        routed = jnp.sum(ys.astype(jnp.float32) * w.reshape(k, 1), axis=0, keepdims=True)
    else:
        ids, w = route(x, p, cfg)
        order, group_sizes = expert_order(ids.reshape(-1), e)
        token = order // k
        ys, shared = expert_mlps(x[token], group_sizes, x, p, cfg, impl)
        ys = ys.astype(jnp.float32) * w.reshape(-1)[order][:, None]
        routed = sum_rows(ys, token, t)
    return _combine(routed, shared, cfg, x.dtype)


def _combine(routed: jax.Array, shared: jax.Array, cfg: TextConfig, dtype) -> jax.Array:
    """The MoE block's output: the routed experts' weighted sum (fp32 [T, D]) scaled, plus the shared expert's."""
    return (cfg.routed_scaling_factor * routed + shared.astype(jnp.float32)).astype(dtype)


def _token_mlps(x: jax.Array, p: dict, cfg: TextConfig, impl: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode token ``x [1, D]`` through its routed experts (array weights; :func:`_row_visits` said the
    pipeline kernel takes them as per-row visits): (their rows [k, D], the shared expert's [1, D], their
    weights fp32 [1, k]). The gate and up of every row go as one launch (``gmm.grouped_matmuls``) and the
    down as one more. Where the shared expert's widths are the experts', it rides along as group E: its
    weights join the routed arrays as a tuple, the router puts it in slot 0 (``route(shared_slot=True)``),
    and its XLA GEMMs and SwiGLU are gone (benchmarks/RESULTS.md#token-mlps)."""
    ps, k = p["shared"], cfg.num_experts_per_tok
    rides = all(not isinstance(w, MXFP8Weight) and w.shape == p[name].shape[1:] for name, w in ps.items())
    ids, w = route(x, p, cfg, shared_slot=rides)
    groups = gmm.RowGroups(ids[0])
    rows = jnp.broadcast_to(x, (ids.shape[1], x.shape[1]))

    def weight(name):
        return (p[name], ps[name][None]) if rides else p[name]

    gate, up = gmm.grouped_matmuls(rows, (weight("gate"), weight("up")), groups,
                                   config=_grouped_matmul_config(rows.shape[0], p["gate"]))
    act = swiglu_oai(gate, up, cfg.swiglu_alpha, cfg.swiglu_limit).astype(x.dtype)
    ys = gmm.grouped_matmul(act, weight("down"), groups, config=_grouped_matmul_config(rows.shape[0], p["down"]))
    if rides:
        return ys[1:], ys[:1], w[:, 1:]
    return ys, dense_mlp(x, ps, cfg, impl), w


def _row_visits(xs: jax.Array, p: dict, impl: str) -> bool:
    """Whether the routed experts' GEMMs over ``xs [M, D]`` all run the kernel on a schedule that takes a
    visit per row (``gmm.RowGroups``: the pipeline, the gemv), so :func:`moe_sorted` may skip the sort."""
    down = p["down"].values if isinstance(p["down"], MXFP8Weight) else p["down"]
    act = jax.ShapeDtypeStruct((xs.shape[0], down.shape[1]), xs.dtype)
    return all(resolve_moe_impl(impl, rows, w) == "pallas"
               and _grouped_matmul_config(rows.shape[0], w).schedule in ("pipeline", "gemv")
               for rows, w in ((xs, p["gate"]), (xs, p["up"]), (act, p["down"])))


# Up to this many (token, slot) pairs (a decode step: batch x experts per token) the pairs are ordered by
# comparing all of them with all (elementwise, fused by XLA) instead of a sort, a bincount and a
# scatter-add, GPU launches of a few microseconds each (benchmarks/RESULTS.md#m3-width-1m-2026-12-06d).
FEW_PAIRS = 64


def expert_order(flat_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order int32 [P]: the pairs sorted by expert id, stable; group_sizes int32 [E]: pairs per expert)
    of the expert ids ``flat_ids`` int32 [P]. Up to :data:`FEW_PAIRS` pairs by pairwise comparison: the
    rank of pair i is the number of pairs before it in (expert, position) order, the same permutation
    as the stable sort."""
    n = flat_ids.shape[0]
    if n > FEW_PAIRS:
        return (jnp.argsort(flat_ids, stable=True).astype(jnp.int32),
                jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32))
    pos = jnp.arange(n, dtype=jnp.int32)
    a, b = flat_ids[:, None], flat_ids[None, :]  # [i, j]
    rank = jnp.sum((b < a) | ((b == a) & (pos[None, :] < pos[:, None])), axis=1, dtype=jnp.int32)
    order = jnp.sum(jnp.where(rank[None, :] == pos[:, None], pos[None, :], 0), axis=1, dtype=jnp.int32)
    sizes = jnp.sum(flat_ids[None, :] == jnp.arange(num_experts, dtype=flat_ids.dtype)[:, None], axis=1,
                    dtype=jnp.int32)
    return order, sizes


def sum_rows(ys: jax.Array, token: jax.Array, t: int) -> jax.Array:
    """fp32 [t, D]: row r of ``ys`` [P, D] added into row ``token[r]``. Up to :data:`FEW_PAIRS` rows as one
    masked reduction, not a scatter launch."""
    if ys.shape[0] > FEW_PAIRS:
        return jnp.zeros((t, ys.shape[1]), jnp.float32).at[token].add(ys)
    return jnp.sum(jnp.where((token[None, :] == jnp.arange(t)[:, None])[..., None], ys[None], 0.0), axis=1)


def moe_dense_reference(x: jax.Array, p: dict, cfg: TextConfig) -> jax.Array:
    """Same maths as :func:`moe_sorted`, computing every expert for every token (tiny configs only)."""
    p = dequantize_tree(p, x.dtype)
    ids, w = route(x, p, cfg)
    combine = jnp.zeros((x.shape[0], cfg.num_local_experts), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(w)  # [T, E]
    prec = dot_precision(x.dtype)  # fp32 stays fp32 on a GPU (XLA's default there is TF32)
    gate = jnp.einsum("td,edf->tef", x, p["gate"], precision=prec)
    up = jnp.einsum("td,edf->tef", x, p["up"], precision=prec)
    act = swiglu_oai(gate, up, cfg.swiglu_alpha, cfg.swiglu_limit).astype(x.dtype)
    per_expert = jnp.einsum("tef,efd->ted", act, p["down"], precision=prec).astype(jnp.float32)
    routed = jnp.einsum("te,ted->td", combine, per_expert, precision=jax.lax.Precision.HIGHEST)
    shared = dense_mlp(x, p["shared"], cfg)
    return _combine(routed, shared, cfg, x.dtype)


# --------------------------------------------------------------------------------------------------
# Expert parallelism: experts split over the mesh's model axis, tokens dispatched by all-to-all


def expert_parallel_axis(cfg: TextConfig) -> str | None:
    """The expert mesh axis when a mesh (``jax.set_mesh``) with MODEL > 1 that divides the experts
    is active, else None (then :func:`moe_sorted` runs unchanged; experts that do not divide are
    replicated by the sharding rules)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.axis_names:
        return None
    n = mesh.shape[MODEL]
    return MODEL if n > 1 and cfg.num_local_experts % n == 0 else None


def _ragged_all_to_all_gathered(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` semantics built from ``all_gather`` (XLA:CPU has no
    ragged-all-to-all): chunk ``operand[input_offsets[j] : + send_sizes[j]]`` of every peer lands at
    ``output_offsets[j]`` of peer j's ``output``. Same offsets, same result; n x the traffic."""
    del recv_sizes
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)
    offs = jax.lax.all_gather(input_offsets, axis_name)
    sizes = jax.lax.all_gather(send_sizes, axis_name)
    dests = jax.lax.all_gather(output_offsets, axis_name)
    r = jnp.arange(output.shape[0])
    for i in range(ops.shape[0]):
        start, size, src = dests[i, me], sizes[i, me], offs[i, me]
        hit = (r >= start) & (r < start + size)
        rows = ops[i][jnp.clip(src + r - start, 0, operand.shape[0] - 1)]
        output = jnp.where(hit.reshape((-1,) + (1,) * (output.ndim - 1)), rows, output)
    return output


def _exchange(*args, axis_name):
    if jax.default_backend() == "cpu":
        return _ragged_all_to_all_gathered(*args, axis_name=axis_name)
    return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)


def moe_expert_parallel(x: jax.Array, p: dict, cfg: TextConfig, axis: str = MODEL,
                        impl: str = "auto") -> jax.Array:
    """:func:`moe_sorted` with the experts split over mesh ``axis`` (E / n per device).

    Tokens are split over every mesh axis; each device routes its tokens, sorts the (token, slot) pairs
    by expert (= by destination device), sends each device its rows with one ragged all-to-all (counts
    exchanged first, receive buffer sized for the worst case n * t * min(k, E/n) rows, so no token is
    ever dropped), runs its local experts as one grouped matmul, and sends the rows back along the
    reverse offsets; the weighted sum per token and the shared expert are as in :func:`moe_sorted`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    n = mesh.shape[axis]
    token_axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    n_tok = 1
    for a in token_axes:
        n_tok *= mesh.shape[a]
    t_all, d = x.shape
    pad = -t_all % n_tok
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    k, e_loc = cfg.num_experts_per_tok, cfg.num_local_experts // n
    P = jax.sharding.PartitionSpec

    def body(xl, router, bias, gate, up, down):
        t = xl.shape[0]
        ids, w = route(xl, {"router": router, "router_bias": bias}, cfg)
        flat = ids.reshape(-1)
        order, _ = expert_order(flat, cfg.num_local_experts)
        token = order // k
        sorted_ids = flat[order]
        dest = sorted_ids // e_loc
        send = jnp.bincount(dest, length=n).astype(jnp.int32)
        in_off = (jnp.cumsum(send) - send).astype(jnp.int32)
        counts = jax.lax.all_gather(send, axis)  # [src, dst]
        me = jax.lax.axis_index(axis)
        before = jnp.arange(n)[:, None] < me
        out_off = jnp.sum(jnp.where(before, counts, 0), 0).astype(jnp.int32)  # where my rows land at each dst
        recv = counts[:, me]
        recv_off = (jnp.cumsum(recv) - recv).astype(jnp.int32)
        back_off = jnp.sum(jnp.where(jnp.arange(n)[None, :] < me, counts, 0), 1).astype(jnp.int32)
        cap = n * t * min(k, e_loc)
        xs = _exchange(xl[token], jnp.zeros((cap, d), xl.dtype), in_off, send, out_off, recv, axis_name=axis)
        lid = _exchange((sorted_ids - dest * e_loc).astype(jnp.int32), jnp.full((cap,), e_loc, jnp.int32),
                        in_off, send, out_off, recv, axis_name=axis)
        o2, sizes = expert_order(lid, e_loc)  # the empty slots (id e_loc) last, in no group
        ys = grouped_expert_mlp(xs[o2], sizes, {"gate": gate, "up": up, "down": down}, cfg, impl)
        ys = jnp.zeros_like(ys).at[o2].set(ys)
        ys = _exchange(ys, jnp.zeros((t * k, d), ys.dtype), recv_off, recv, back_off, send, axis_name=axis)
        ys = ys.astype(jnp.float32) * w.reshape(-1)[order][:, None]
        return sum_rows(ys, token, t)

    tok = P(token_axes, None)
    routed = jax.shard_map(
        body,
        in_specs=(tok, P(), P(), P(axis), P(axis), P(axis)),
        out_specs=tok,
        check_vma=False,
    )(xp, p["router"], p["router_bias"], p["gate"], p["up"], p["down"])[:t_all]
    shared = dense_mlp(x, p["shared"], cfg)
    return _combine(routed, shared, cfg, x.dtype)
