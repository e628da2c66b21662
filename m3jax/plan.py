"""Per-device memory plan of MiniMax-M3 sharded over N devices: ``python -m m3jax.plan``.

    python -m m3jax.plan --config minimax_m3 --devices 8 --hbm-gb 192 --ctx 1000000 --dtype bfloat16
    python -m m3jax.plan --config minimax_m3 --devices 8 --hbm-gb 141 --ctx 1000000 --dtype mxfp8
    python -m m3jax.plan --config minimax_m3 --hosts 2 --devices 8 --hbm-gb 141 --ctx 1000000 --dtype bfloat16

``--dtype mxfp8`` counts what ``load_pretrained(..., weights="mxfp8")`` holds (the generate CLI's
``--weights mxfp8``): MXFP8 weights at 1 byte per weight + 1 byte of scale per 32 weights, everything else BF16.

The strategy is the one of docs/SHARDING.md and of :data:`m3jax.sharding.RULES`: one ``model`` axis
of N devices; experts split N ways (expert parallel), query heads / dense MLP / shared expert /
vocabulary split N ways (tensor parallel), KV and index projections replicated when N does not divide
the 4 KV heads; the KV and index caches split by pages over the N devices (context parallel, block
striped), each prefill chunk's index scoring and attention run on every device over its own pages
and are merged by log-sum-exp. Weights are counted from the parameter declarations through the same
rule table the loader uses; the caches with :func:`m3jax.cache.cache_bytes`. GB = 1e9 bytes.

``--hosts H``: a job of H processes (one per host, ``--devices`` each; README "Several hosts"): one
mesh of H x ``--devices`` devices under the same rules, so the model axis, and with it the expert
all-to-all and the tensor-parallel reductions, crosses the hosts' network.

Exit status: 0 the plan fits, 1 it does not (the table says by how much and the largest context that
fits), 2 bad arguments or config (one ``error:`` line; ``--debug`` for the traceback).
"""

from __future__ import annotations

import argparse
import math

from m3jax import cli
from m3jax import sharding as sh
from m3jax.cache import cache_bytes
from m3jax.checkpoint import tensor_plan
from m3jax.config import M3Config, describe_presets, load_config, preset
from m3jax.memory import weight_bytes

GB = 1e9


class PlanMesh:
    """The shape of a mesh without devices (the spec functions only read ``.shape``)."""

    def __init__(self, devices: int, data: int = 1):
        self.shape = {sh.DATA: data, sh.MODEL: devices // data}


def weights_per_device(cfg: M3Config, mesh, dtype: str) -> tuple[float, float]:
    """(bytes on the most loaded device, bytes of the whole model). ``mxfp8``: the parameters
    ``load_pretrained(..., weights="mxfp8")`` holds (``param_specs(cfg, "mxfp8")``): the quantised weights
    as fp8 values (1 byte) + uint8 E8M0 scales (1 byte per 32 inputs), sharded as the weights they
    replace (:func:`m3jax.sharding.mxfp8_partition_specs`); the rest BF16 (fp32 leaves fp32)."""
    per_dev = total = 0.0

    def count(s, spec):
        nonlocal per_dev, total
        if s.dtype in ("float8_e4m3fn", "uint8"):
            b = 1.0
        elif s.dtype == "float32":
            b = 4.0
        else:
            b = 2.0 if dtype in ("bfloat16", "mxfp8") else 4.0
        split = math.prod(mesh.shape[m] for part in spec if part is not None for m in sh.rule_mesh_axes(part))
        n = math.prod(s.shape)
        per_dev += n / split * b
        total += n * b

    for e in tensor_plan(cfg, "mxfp8" if dtype == "mxfp8" else "dequantize"):
        if e.mxfp8:
            specs = sh.mxfp8_partition_specs(e.spec, mesh, name="/".join(map(str, e.path)))
            count(e.spec.values, specs.values)
            count(e.spec.scales, specs.scales)
        else:
            count(e.spec, sh.spec_for(e.spec.axes, e.spec.shape, mesh))
    return per_dev, total


def cache_per_device(cfg: M3Config, mesh, batch: int, ctx: int, kv_bytes: int) -> tuple[float, float]:
    """(KV bytes, index-key bytes) per device; pages split over the model axis when it divides them."""
    t = cfg.text
    bs = t.index_block_size
    ctx = sh.padded_capacity(ctx, cfg, mesh)  # whole pages, a multiple of the model axis per sequence
    pages = batch * -(-ctx // bs)
    tokens = pages * bs
    kv = tokens * sum(2 * t.num_key_value_heads * t.head_dim for _ in range(t.num_hidden_layers)) * kv_bytes
    index_bytes = 1 if t.index_cache_dtype == "float8_e4m3fn" else kv_bytes  # fp8 index keys: one byte each
    index = tokens * sum(t.index_head_dim for i in range(t.num_hidden_layers) if t.is_sparse_attention(i)) * index_bytes
    assert kv + index == cache_bytes(cfg, batch, ctx, kv_bytes)
    spec = sh.spec_for(sh.CACHE_KV_AXES, (pages, bs, t.num_key_value_heads, t.head_dim), mesh)
    split = math.prod(mesh.shape[m] for part in spec if part is not None for m in sh.rule_mesh_axes(part))
    return kv / split, index / split


def activations_per_device(cfg: M3Config, n: int, batch: int, ctx: int, chunk: int,
                           kv_dtype_bytes: int = 2) -> dict[str, float]:
    """Largest live transients of one prefill chunk of ``chunk`` tokens (fp32 unless noted), per device."""
    t = cfg.text
    c, ca = chunk, min(cfg.attention_chunk, chunk)
    d, nh, kh, h = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    k_eff = min(t.num_experts_per_tok, max(1, t.num_local_experts // n))
    s_loc = -(-ctx // n)
    return {
        # residual stream, normed input, attention and MLP outputs: [C, D]
        "residual": 4 * c * d * 4,
        # q of all heads (gathered for context-parallel attention), the partial output and its merge
        "attention_qo": 3 * c * nh * h * 4,
        # index scores of one query sub-chunk against the local S/n keys (+ the top-k ranking copy)
        "index_scores": 2 * ca * t.index_n_heads * s_loc * 4,
        # gathered selected K/V blocks of one query sub-chunk
        "selected_kv": 2 * ca * kh * t.index_topk_blocks * t.index_block_size * h * 4,
        # expert parallel: worst-case receive buffer (no token dropped) n * (C/n) * min(k, E/n) rows,
        # its gate / up / activation [rows, Fe] and the returned rows
        "moe_dispatch": c * k_eff * (d * 2 + 3 * t.intermediate_size * 4 + d * 4),
        # dense-MLP layers, width split n ways
        "dense_mlp": 3 * c * -(-t.dense_intermediate_size // n) * 4,
        # logits of the last token of each sequence, vocab split n ways (+ the gathered argmax input)
        "logits": batch * t.vocab_size / n * 4 * 2,
        # one layer's K/V + index keys of the key window, gathered on every device: the full-attention
        # layers' prefill and the MSA prefill chunks of short windows (head-split, by the rule of
        # msa.parallel.prefill_context_parallel) read the page-split cache through a gathered view
        # (docs/SHARDING.md); long-window MSA chunks and the kernels path's decode read only local pages
        "cache_window": batch * sh.padded_capacity(ctx, cfg, PlanMesh(n))
        * (2 * kh * h + t.index_head_dim) * kv_dtype_bytes,
    }


def workspace_bytes(hbm: float) -> float:
    """CUDA context, cuBLAS / cuDNN workspaces and NCCL buffers (~2 GB) + 5% allocator headroom."""
    return 2 * GB + 0.05 * hbm


def plan(cfg: M3Config, *, devices: int, hbm_gb: float, ctx: int, dtype: str, batch: int = 1, chunk: int = 8192,
         kv_dtype_bytes: int = 2, data: int = 1, workspace: float | None = None, hosts: int = 1) -> dict:
    """The per-device plan on a ``data`` x ``devices // data`` mesh of devices with ``hbm_gb`` each (also
    what ``python -m m3jax.generate`` checks before it allocates anything on more than one device).
    ``devices`` counts every host's; ``hosts`` only labels the plan (the rules see one mesh).
    ``workspace``: bytes per device outside the arrays (default :func:`workspace_bytes`, the GPU's)."""
    mesh = PlanMesh(devices, data)
    n = mesh.shape[sh.MODEL]
    w, w_total = weights_per_device(cfg, mesh, dtype)
    kv, idx = cache_per_device(cfg, mesh, batch, ctx, kv_dtype_bytes)
    acts = activations_per_device(cfg, n, batch, ctx, chunk, kv_dtype_bytes)
    hbm = hbm_gb * GB
    ws = workspace_bytes(hbm) if workspace is None else workspace
    total = w + kv + idx + sum(acts.values()) + ws
    return {
        "devices": devices, "hosts": hosts, "data": data, "hbm": hbm, "dtype": dtype, "ctx": ctx, "batch": batch, "chunk": chunk,
        "weights": w, "weights_total": w_total, "kv_cache": kv, "index_cache": idx,
        "activations": sum(acts.values()), "activation_terms": acts, "workspace": ws,
        "total": total, "fits": total <= hbm, "headroom": hbm - total,
        "replicated": sh.validate_rules(cfg, mesh),
    }


def max_ctx(cfg: M3Config, *, upper: int, **plan_kw) -> int:
    """Largest context (to 1024 tokens, at most ``upper``) whose :func:`plan` fits; 0 if none does."""
    lo, hi = 0, upper
    if plan(cfg, ctx=upper, **plan_kw)["fits"]:
        return upper
    while hi - lo > 1024:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(cfg, ctx=mid, **plan_kw)["fits"] else (lo, mid)
    return lo


def describe(r: dict) -> str:
    g = lambda x: f"{x / GB:8.2f} GB"  # noqa: E731
    lines = [
        f"MiniMax-M3 on {r['devices']} devices"
        + (f" ({r['hosts']} hosts x {r['devices'] // r['hosts']})" if r.get("hosts", 1) > 1 else "")
        + f" x {r['hbm'] / GB:.0f} GB"
        + (f" (data {r['data']} x model {r['devices'] // r['data']})" if r["data"] > 1 else "") + f", {r['dtype']} weights, "
        f"context {r['ctx']:,} tokens x batch {r['batch']}, prefill chunk {r['chunk']}",
        f"  weights      {g(r['weights'])}   (whole model {r['weights_total'] / GB:.1f} GB)",
        f"  KV cache     {g(r['kv_cache'])}   (pages split {r['devices'] // r['data']} ways, block-striped)",
        f"  index cache  {g(r['index_cache'])}",
        f"  activations  {g(r['activations'])}   ("
        + ", ".join(f"{k} {v / GB:.2f}" for k, v in r["activation_terms"].items()) + ")",
        f"  workspace    {g(r['workspace'])}",
        f"  total        {g(r['total'])}   of {r['hbm'] / GB:.0f} GB -> "
        + (f"fits ({r['headroom'] / GB:.1f} GB free)" if r["fits"] else f"DOES NOT FIT (over by {-r['headroom'] / GB:.1f} GB)"),
    ]
    for note in r["replicated"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--config", default="minimax_m3", help=f"preset: {describe_presets()}")
    src.add_argument("--checkpoint", help="directory with a config.json")
    ap.add_argument("--devices", type=cli.positive_int, default=8, help="devices (per host with --hosts)")
    ap.add_argument("--hosts", type=cli.positive_int, default=1,
                    help="hosts of one job, --devices each: one mesh over all of them")
    ap.add_argument("--data", type=cli.positive_int, default=1,
                    help="data-parallel replicas (mesh data x devices/data; the model axis is devices/data)")
    ap.add_argument("--hbm-gb", type=cli.positive_float, default=141.0, help="memory per device in GB (1e9 bytes)")
    ap.add_argument("--ctx", type=cli.positive_int, default=1_000_000)
    ap.add_argument("--batch", type=cli.positive_int, default=1)
    ap.add_argument("--chunk", type=cli.positive_int, default=8192, help="prefill chunk (tokens)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "mxfp8", "float32"])
    cli.add_debug_flag(ap)
    args = ap.parse_args(argv)
    cfg = load_config(args.checkpoint) if args.checkpoint else preset(args.config)
    devices = args.hosts * args.devices
    if devices % args.data:
        raise cli.UsageError(f"--data {args.data} does not divide the {devices} devices")
    kw = dict(devices=devices, hosts=args.hosts, data=args.data, hbm_gb=args.hbm_gb, dtype=args.dtype, batch=args.batch,
              chunk=args.chunk)
    r = plan(cfg, ctx=args.ctx, **kw)
    weights = "mxfp8" if args.dtype == "mxfp8" else "dequantize"
    assert abs(r["weights_total"] - weight_bytes(cfg, 4 if args.dtype == "float32" else 2, weights)) < 1
    if not r["fits"]:
        r["max_ctx"] = max_ctx(cfg, upper=args.ctx, **kw)
    print(describe(r))
    if "max_ctx" in r:
        print(f"  largest context that fits with this chunk: ~{r['max_ctx']:,} tokens")
    return r


def exit_status(r: dict) -> int:
    """0 when the plan fits, 1 when it does not: scripts can branch on the answer."""
    return 0 if r["fits"] else 1


if __name__ == "__main__":
    cli.run(main, exit_code=exit_status)
