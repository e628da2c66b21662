"""MSA at long context: one probe pass over a held-out row with needles, selections from the model's own
path (the index kernels on a GPU), recall of the dense attention mass streamed over query chunks and
key tiles. See README.md beside this file.

    # GPU (one H200): m3-small at 128K through the kernels, JSON + plots + summary.md under $OUT
    python experiments/2026-12-01_probe_long/probe_long.py --ctx 131072 --out $OUT
    # CPU: the same at 8K on the jnp reference path (the committed fallback results/probe_8k.json)
    python experiments/2026-12-01_probe_long/probe_long.py --ctx 8192 --dtype float32 --query-chunk 256 \\
        --key-tile 2048 --out experiments/2026-12-01_probe_long/results
    # plots + summary.md again from a JSON
    python experiments/2026-12-01_probe_long/probe_long.py --plot results/probe_128k.json --out plots

The row is ``--ctx`` tokens of held-out standard-library text (:func:`m3jax.needle.heldout_stream`,
files the model never trained on) with a ``KEY <k> = <v>`` line planted at each of ``--depths`` and,
at the end, the queries of all of them (:func:`m3jax.needle.multi_needle_row`, the training format).

JSON (``probe_<ctx/1024>k.json``): settings, device, ``seconds`` (load, probe, total), peak device
memory, per MSA layer ``summary`` (recall / output error / margin), ``recall_vs_distance`` (dense mass
share, recall and share of selections per log2 bin of the query-to-block distance), ``needles``
(greedy retrieval of each value under teacher forcing; per MSA layer and KV group the share of the
value-predicting positions whose selection holds the needle's block, and the blocks selected at the
first one), and ``selection_maps`` (per map layer and KV group, the share of (query, key block) pairs
selected, pooled into at most 128 x 128 cells).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)
MAP_CELLS = 128


def _memory() -> dict:
    import jax

    stats = jax.devices()[0].memory_stats() or {}  # None off the GPU
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_limit")}


def distance_bins(nb: int) -> list[tuple[int, int]]:
    """[lo, hi) block-distance bins: 0, 1, 2-3, 4-7, ... up to nb."""
    bins, lo = [(0, 1)], 1
    while lo < nb:
        bins.append((lo, min(2 * lo, nb)))
        lo *= 2
    return bins


def reduce_probe(res, row, needle_positions, map_layers) -> dict:
    """The JSON content of one probe pass (batch of one row)."""
    bs = res.block_size
    out = {"summary": res.summary(), "recall_vs_distance": {}, "needles": [], "selection_maps": {}}
    for i in res.msa_layers:
        mass, _ = res.recall_by_distance(i)
        sel_mass = res.layers[i].selected_mass_by_distance.astype(np.float64)
        counts = res.distance_histogram(i).astype(np.float64)
        bins = distance_bins(len(mass))
        share = lambda x, lo, hi: float(x[lo:hi].sum() / max(x.sum(), 1e-30))  # noqa: E731
        out["recall_vs_distance"][str(i)] = {
            "bins": bins,
            "dense_mass_share": [share(mass, lo, hi) for lo, hi in bins],
            "recall": [float(sel_mass[lo:hi].sum() / mass[lo:hi].sum()) if mass[lo:hi].sum() > 0 else None
                       for lo, hi in bins],
            "selection_share": [share(counts, lo, hi) for lo, hi in bins],
        }
    logits = res.logits[0]
    for j, (at, q_at, n_val) in enumerate(needle_positions):
        pred = np.arange(q_at - 1, q_at - 1 + n_val)  # logits at p predict token p + 1
        value = row.tokens[q_at : q_at + n_val]
        x = logits[pred].astype(np.float64)
        top = x.max(-1, keepdims=True)
        lp = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))
        entry = {"key": row.keys[j], "value": row.secrets[j], "depth": row.depths[j], "value_at": at,
                 "query_value_at": q_at, "needle_block": at // bs, "distance_blocks": int(pred[0] // bs - at // bs),
                 "correct": bool((logits[pred].argmax(-1) == value).all()),
                 "value_logprob": float(np.take_along_axis(lp, value[:, None], -1).mean()),
                 "block_selected": {}, "selected_at_first": {}, "recall_at_answer": {}}
        for i in res.msa_layers:
            sel = res.layers[i].block_indices[0][:, pred]  # [K, v, topk]
            entry["block_selected"][str(i)] = (sel == at // bs).any(-1).mean(-1).tolist()  # per KV group
            entry["selected_at_first"][str(i)] = sel[:, 0].tolist()
            entry["recall_at_answer"][str(i)] = float(res.layers[i].recall[0][:, pred].mean())
        out["needles"].append(entry)
    groups = res.layers[res.msa_layers[0]].block_indices.shape[1] if res.msa_layers else 0
    for i in map_layers:
        out["selection_maps"][str(i)] = {
            str(g): np.round(res.selection_map(i, g, rows=MAP_CELLS, cols=MAP_CELLS), 4).tolist() for g in range(groups)}
    return out


def run(args) -> dict:
    import jax

    import m3jax
    from m3jax.needle import DEFAULT_CHECKPOINT, heldout_stream, multi_needle_row
    from m3jax.probe import probe
    from m3jax.data import text_encoder

    t0 = time.time()
    ckpt = Path(args.checkpoint or DEFAULT_CHECKPOINT)
    model = m3jax.load_pretrained(ckpt, dtype=args.dtype, attention_impl=args.attention_impl, progress=False)
    t = model.config.text
    tok = None
    if (ckpt / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    encode = text_encoder(tok, t.vocab_size)
    eos = t.eos_token_id[0] if isinstance(t.eos_token_id, tuple) else (2 if t.eos_token_id is None else t.eos_token_id)
    stream = heldout_stream(encode, args.ctx + 1024, eos)
    row = multi_needle_row(stream, args.ctx, args.depths, np.random.default_rng([args.seed, args.ctx]), encode)
    t_load = time.time() - t0
    msa_layers = [i for i in range(t.num_hidden_layers) if t.is_sparse_attention(i)]
    map_layers = args.map_layers if args.map_layers is not None else sorted({msa_layers[0], msa_layers[len(msa_layers) // 2], msa_layers[-1]}) if msa_layers else []
    print(f"probe: {ckpt.name}, ctx {args.ctx}, {model.config.attention_impl} path, {args.dtype}, "
          f"block {t.index_block_size} top-k {t.index_topk_blocks}, {len(args.depths)} needles", flush=True)
    t1 = time.time()
    res = probe(model, row.tokens[None], query_chunk=args.query_chunk, key_tile=args.key_tile,
                share_compilation=True, progress=args.progress)
    t_probe = time.time() - t1
    positions = list(zip(row.value_at, row.query_value_at, row.value_len))
    out = {
        "checkpoint": str(ckpt), "ctx": args.ctx, "dtype": args.dtype, "attention_impl": model.config.attention_impl,
        "block_size": t.index_block_size, "topk": t.index_topk_blocks, "msa_layers": msa_layers,
        "kv_groups": t.index_n_heads, "query_chunk": args.query_chunk, "key_tile": args.key_tile, "seed": args.seed,
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "seconds": {"load_and_data": round(t_load, 1), "probe": round(t_probe, 1)}, "memory": _memory(),
        **reduce_probe(res, row, positions, map_layers),
    }
    out["seconds"]["total"] = round(time.time() - t0, 1)
    return out


def figures(res: dict) -> dict:
    """{name: matplotlib Figure}: selection maps, recall vs distance, needle selection (from the JSON)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    figs = {}
    maps = res["selection_maps"]
    nb = -(-res["ctx"] // res["block_size"])
    if maps:
        layers = sorted(maps, key=int)
        groups = sorted(maps[layers[0]], key=int)
        fig, axes = plt.subplots(len(groups), len(layers), figsize=(4.2 * len(layers), 3.6 * len(groups)), squeeze=False,
                                 layout="constrained")
        for c, layer in enumerate(layers):
            for r, g in enumerate(groups):
                ax, m = axes[r, c], np.asarray(maps[layer][g])
                pos = m[m > 0]
                im = ax.imshow(np.where(m > 0, m, np.nan), aspect="auto", interpolation="nearest", cmap="viridis",
                               norm=LogNorm(pos.min(), 1.0) if pos.size else None, extent=(0, nb, res["ctx"], 0))
                for n in res["needles"]:
                    ax.axvline(n["needle_block"] + 0.5, color="r", lw=0.6, ls=":")
                ax.set(title=f"layer {layer}, KV group {g}", xlabel="key block", ylabel="query position")
        fig.colorbar(im, ax=axes, shrink=0.8, label="share of (query, block) pairs selected")
        fig.suptitle(f"MSA selections at ctx {res['ctx']} (block {res['block_size']}, top-{res['topk']}); "
                     "red: needle blocks")
        figs["selection_maps"] = fig
    rvd = res["recall_vs_distance"]
    if rvd:
        fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.8))
        for layer, d in sorted(rvd.items(), key=lambda kv: int(kv[0])):
            x = [max(lo, 0.5) for lo, _ in d["bins"]]  # bin starts; distance 0 drawn at 0.5 on the log axis
            a.plot(x, [np.nan if r is None else r for r in d["recall"]], "o-", ms=3, label=f"layer {layer}")
            b.plot(x, d["dense_mass_share"], "o-", ms=3, label=f"layer {layer}")
            c.plot(x, d["selection_share"], "o-", ms=3, label=f"layer {layer}")
        for ax, title in ((a, "recall of the dense mass at that distance"), (b, "share of the dense mass"),
                          (c, "share of the selected blocks")):
            ax.set(xscale="log", xlabel="query-to-block distance (blocks, log2 bins; own block at 0.5)", title=title)
        a.set_ylim(0, 1.02)
        a.legend(fontsize=7)
        fig.suptitle(f"MSA at ctx {res['ctx']}: what the selection keeps, by distance")
        fig.tight_layout()
        figs["recall_vs_distance"] = fig
    if res["needles"]:
        layers = sorted(res["needles"][0]["block_selected"], key=int)
        sel = np.array([[np.mean(n["block_selected"][layer]) for layer in layers] for n in res["needles"]])
        fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(layers), 0.5 + 0.45 * len(res["needles"])))
        ax.imshow(sel, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (r, c), v in np.ndenumerate(sel):
            ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.5 else "k")
        ax.set_xticks(range(len(layers)), [f"L{layer}" for layer in layers])
        ax.set_yticks(range(len(res["needles"])), [f"depth {n['depth']:g} {'✓' if n['correct'] else '✗'}"
                                                   for n in res["needles"]])
        ax.set_title("needle block selected at the answer", fontsize=9)
        fig.tight_layout()
        figs["needles"] = fig
    return figs


def summary_markdown(res: dict) -> str:
    mem = res["memory"].get("peak_bytes_in_use")
    lines = [f"# MSA probe at {res['ctx']} tokens — {Path(res['checkpoint']).name}", "",
             f"{res['device']}, jax {res['jax']}, {res['attention_impl']} path, {res['dtype']}, block "
             f"{res['block_size']} top-k {res['topk']}; probe {res['seconds']['probe']} s "
             f"(total {res['seconds']['total']} s), peak device memory "
             + (f"{mem / 2**30:.2f} GiB" if mem else "n/a (CPU)") + ".", "",
             "| layer | recall mean | recall min | output error mean | margin median |", "|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['recall_mean']:.4f} | {r['recall_min']:.4f} | {r['output_error_mean']:.4f} | "
              f"{r['margin_median']:.4f} |" for r in res["summary"]]
    layers = [str(r["layer"]) for r in res["summary"]]
    lines += ["", "| needle depth | distance (blocks) | retrieved | value log-prob | " + " | ".join(
        f"L{layer} block sel." for layer in layers) + " |", "|---" * (4 + len(layers)) + "|"]
    for n in res["needles"]:
        lines.append(f"| {n['depth']:g} | {n['distance_blocks']} | {'yes' if n['correct'] else 'no'} | "
                     f"{n['value_logprob']:.2f} | " + " | ".join(
                         f"{np.mean(n['block_selected'][layer]):.2f}" for layer in layers) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(res: dict, out: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fig_name, fig in figures(res).items():
        written.append(out / f"{name}_{fig_name}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    written.append(out / f"{name}_summary.md")
    written[-1].write_text(summary_markdown(res))
    return written


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF-layout checkpoint dir (default: the built-in m3-small)")
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS), help="needle depths (shares of the row)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--attention-impl", default="auto", choices=["auto", "reference", "pallas"],
                    help="auto: the kernels on a GPU (selections from the index kernels), else the jnp reference")
    ap.add_argument("--query-chunk", type=int, default=1024, help="queries per streamed chunk")
    ap.add_argument("--key-tile", type=int, default=8192, help="keys per tile of the dense pass")
    ap.add_argument("--map-layers", type=int, nargs="*", default=None,
                    help="MSA layers with stored selection maps (default: first, middle, last)")
    ap.add_argument("--out", default=None, help="output dir (default: $OUT, else benchmarks/out)")
    ap.add_argument("--plot", type=Path, default=None, help="only write plots + summary.md from this JSON")
    ap.add_argument("--progress", action="store_true", help="a progress bar over layers")
    args = ap.parse_args(argv)
    import os

    args.out = Path(args.out or os.environ.get("OUT") or HERE.parents[1] / "benchmarks" / "out")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        res = json.loads(args.plot.read_text())
        name = args.plot.stem
    else:
        res = run(args)
        name = f"probe_{args.ctx // 1024}k" if args.ctx % 1024 == 0 else f"probe_{args.ctx}"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(res, separators=(",", ":")))  # maps: 100K numbers
        print(f"wrote {args.out / (name + '.json')}")
    try:
        written = write_outputs(res, args.out, name)
    except ImportError as e:  # a machine without matplotlib still gets the JSON: plot it later with --plot
        print(f"plots skipped ({e}); the JSON is written: --plot {args.out / (name + '.json')} draws them")
        written = []
    for p in written:
        print("wrote", p)
    print(summary_markdown(res))
    return 0 if all(math.isfinite(r["recall_mean"]) for r in res["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
