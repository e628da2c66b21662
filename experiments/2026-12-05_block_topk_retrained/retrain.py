"""MSA block size x top-k with the indexer retrained per cell: the shipped m3-small's index branch
retrained (``m3jax.train --mode indexer_only``) at each block size, then scored exactly as the
inference-only sweep scores a cell. See README.md beside this file.

    python experiments/2026-12-05_block_topk_retrained/retrain.py --cells cross --max-seconds 540   # GPU, 16K
    python experiments/2026-12-05_block_topk_retrained/retrain.py --cells full --max-seconds 540
    python experiments/2026-12-05_block_topk_retrained/retrain.py --report     # table + plot from results/
    python experiments/2026-12-05_block_topk_retrained/retrain.py --quick --checkpoint DIR --ctx 64 --steps 1  # CPU

**One training per block size.** ``indexer_only`` trains the KL over every visible block (the dense
warm-up's support, :mod:`m3jax.indexer_objective`): top-k never enters its objective, so the indexer
trained at block b serves every cell (b, k). The grid's 4 block sizes are 4 trainings, whatever the
cells; ``--cells cross`` (one row and one column through the shipped cell, 64 x 8) saves evaluations,
not trainings.

**Scoring.** The retrained model is the shipped model with only its index weights replaced
(:func:`m3jax.train.with_index_branch`): main weights bit-identical to the inference-only cells. Rows,
metrics and code are the inference-only sweep's (``../2026-12-01_block_topk_retrieval/sweep.py``,
imported: :func:`load_model`, :func:`eval_set`, :func:`evaluate`). Its recorded cells are reused when
the setup (checkpoint, ctx, rows, seed, dtype) is the same; missing ones, and the dense baseline, are
scored here with the shipped indexer.

**Files.** ``<out>/retrained.jsonl``: one line per scored cell (``indexer``: ``retrained`` or
``shipped``), keyed by setup id; rerunning the same command skips finished work (a finished training
is its run folder's ``summary.json`` under ``--runs``). ``--max-seconds`` starts no training or cell
past it. ``--report`` (and the end of every run) writes ``<out>/side_by_side.json``,
``<out>/side_by_side.md`` and ``<plots>/retrained_vs_inference.png``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import m3jax
from m3jax import train as tr

HERE = Path(__file__).resolve().parent
INFERENCE_SWEEP = HERE.parent / "2026-12-01_block_topk_retrieval"
RESULTS_FILE = "retrained.jsonl"


def _load_sweep():
    spec = importlib.util.spec_from_file_location("block_topk_retrieval_sweep", INFERENCE_SWEEP / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


sweep = _load_sweep()
bt = sweep.bt


def grid_cells(kind: str, blocks, topks, native: tuple[int, int]) -> list:
    """The cells to score, native cell first: ``full`` = blocks x topks; ``cross`` = the native block's
    row and the native top-k's column."""
    nb, nk = native
    pairs = [(b, k) for b in blocks for k in topks]
    if kind == "cross":
        pairs = [(b, k) for b, k in pairs if b == nb or k == nk]
    pairs.sort(key=lambda p: (p != native, p[0] != nb, p))
    return [bt.Cell(bt.cell_name(b, k), b, k) for b, k in pairs]


def train_argv(block: int, topk: int, run: Path, ckpt: Path | None, args) -> list[str]:
    """``m3jax.train`` arguments of the retraining at ``block`` (``topk`` only sets the run's own recall
    probe: the objective does not read it). The task data of the shipped model's training."""
    argv = ["--mode", "indexer_only", "--block-size", str(block), "--topk", str(topk), "--seq-len", str(args.ctx),
            "--batch", "1", "--steps", str(args.steps), "--lr", str(args.lr), "--warmup", str(args.warmup),
            "--data", "retrieval", "--kv-per-1k", "8", "--task-share", "0.5", "--data-mb", str(args.data_mb),
            "--eval-every", str(10**9), "--eval-batches", "1", "--ckpt-every", str(10**9), "--save-format", "float32",
            "--attention-impl", args.attention_impl, "--dtype", args.train_dtype, "--seed", str(args.seed),
            "--out", str(run), "--resume"]
    if args.train_seconds:
        argv += ["--stop-after", str(args.train_seconds)]
    if ckpt is not None:
        argv += ["--init-from", str(ckpt)]
        if (ckpt / "tokenizer.json").exists():
            argv += ["--tokenizer-from", str(ckpt)]
        else:  # a tokenizer-less test checkpoint: train a small one (the corpus must be tokenised somehow)
            argv += ["--tokenizer-mb", "0.3"]
    return argv


def retrained_model(shipped, run: Path, block: int, dtype: str):
    """The shipped model with the index weights trained in ``run`` and its block size."""
    trained = m3jax.load_pretrained(run / "model", dtype=dtype, attention_impl="reference", progress=False)
    index = [lp.get("index") for lp in trained.params["text"]["layers"]]
    cfg = shipped.config.replace_text(index_block_size=block)
    return m3jax.M3Model(cfg, tr.with_index_branch(shipped.params, index), shipped.mesh)


def _key(r: dict) -> tuple:
    return r.get("indexer", "shipped"), r["cell"]


def inference_rows(setup_id: str, own: list[dict]) -> dict[str, dict]:
    """{cell: row} scored with the shipped indexer on this setup: the inference-only sweep's recorded
    rows, then this sweep's own."""
    rows = bt.read_rows(INFERENCE_SWEEP / "results" / "quality.jsonl") + [r for r in own if r.get("indexer") == "shipped"]
    return {r["cell"]: {**r, "indexer": "shipped"} for r in rows if r.get("setup_id") == setup_id and "error" not in r}


def run(args) -> list[dict]:
    t_start = time.time()
    left = lambda: args.max_seconds - (time.time() - t_start) if args.max_seconds else math.inf  # noqa: E731
    shipped, ckpt = sweep.load_model(args)
    t = shipped.config.text
    native = (t.index_block_size, t.index_topk_blocks)
    evs = sweep.eval_set(shipped, ckpt, args)
    out = Path(args.out) / RESULTS_FILE
    own = [r for r in bt.read_rows(out) if r.get("setup_id") == evs.setup_id and "error" not in r]
    done = {_key(r) for r in own}
    cells = grid_cells(args.cells, args.blocks, args.topks, native)
    print(f"retrained sweep: setup {evs.setup_id}, {len(cells)} cells ({args.cells}), "
          f"{sum(('retrained', c.name) in done for c in cells)} done", flush=True)
    rows = []

    def score(model, cell, indexer: str, extra: dict) -> None:
        t0 = time.time()
        row = {**sweep.evaluate(model, cell, evs, args), "indexer": indexer, **extra}
        bt._record(out, rows, row, t0)

    if bt.DENSE not in inference_rows(evs.setup_id, own):  # Δ log-lik needs the dense baseline
        score(shipped, bt.Cell(bt.DENSE, None, None), "shipped", {})
    for block in sorted({c.block_size for c in cells}, key=lambda b: (b != native[0], b)):
        mine = [c for c in cells if c.block_size == block]
        todo = [c for c in mine if ("retrained", c.name) not in done]
        if todo:
            rundir = Path(args.runs) / f"b{block}"
            if not (rundir / "summary.json").exists():
                if left() < args.train_seconds + 150:  # + corpus, compile, evaluations and save
                    print(f"--max-seconds: no time for the block-{block} training; the same command continues",
                          flush=True)
                    break
                print(f"== training the indexer at block {block} ({rundir})", flush=True)
                rc = tr.main(train_argv(block, native[1], rundir, ckpt, args))
                if rc:
                    raise SystemExit(f"the block-{block} training ended with status {rc}")
            summary = json.loads((rundir / "summary.json").read_text())
            train_info = {"train": {k: summary.get(k) for k in ("steps", "scheduled_steps", "seq_len", "train_seconds",
                                                                "attention_impl", "dtype", "heldout_kl")},
                          "trained_block_size": block}
            model = retrained_model(shipped, rundir, block, args.dtype)
            for c in todo:
                if left() <= 0:
                    break
                score(model, c, "retrained", train_info)
        have = inference_rows(evs.setup_id, own + rows)
        for c in mine:
            if c.name not in have and left() > 0:
                score(shipped, c, "shipped", {})
        if left() <= 0:
            print("--max-seconds spent; the same command continues", flush=True)
            break
    report(Path(args.out), Path(args.plots), evs.setup_id)
    return rows


# --------------------------------------------------------------------------------------------------
# Side by side


def _se(p: float | None, n: int) -> float | None:
    """Binomial standard error of an accuracy over n trials."""
    return None if p is None or not n else math.sqrt(max(p * (1 - p), 0.0) / n)


def side_by_side(own: list[dict], setup_id: str) -> list[dict]:
    """Per retrained cell: the inference-only and the retrained scores (needle accuracy with its
    binomial standard error, Δ log-lik vs dense over the tail, recall of the dense mass)."""
    shipped = inference_rows(setup_id, own)
    dense_ll = shipped.get(bt.DENSE, {}).get("ll_tail")
    out = []
    for r in sorted((r for r in own if r.get("indexer") == "retrained" and r.get("setup_id") == setup_id
                     and "error" not in r), key=lambda r: (r["block_size"], r["topk"])):
        n = r["setup"]["n_needles"]
        entry = {"cell": r["cell"], "block_size": r["block_size"], "topk": r["topk"], "n_needles": n,
                 "n_docs": r["setup"]["n_docs"], "ctx": r["setup"]["ctx"], "train_steps": r["train"]["steps"]}
        for name, row in (("inference", shipped.get(r["cell"])), ("retrained", r)):
            if row is None:
                continue
            acc = row.get("needle_acc")
            entry[name] = {"needle_acc": acc, "needle_acc_se": _se(acc, n), "recall": row.get("recall_tail"),
                           "dll_vs_dense": None if dense_ll is None else row["ll_tail"] - dense_ll,
                           "needle_block_selected": row.get("needle_block_selected")}
        out.append(entry)
    return out


def table_markdown(entries: list[dict]) -> str:
    f = lambda v, s="{:.3f}": "" if v is None else s.format(v)  # noqa: E731
    head = ("| cell | steps | needle acc, inference-only | needle acc, retrained | Δ ll vs dense, inference-only "
            "| Δ ll vs dense, retrained | recall, inference-only | recall, retrained |\n" + "|---" * 8 + "|\n")
    lines = []
    for e in entries:
        i, r = e.get("inference", {}), e.get("retrained", {})
        acc = lambda d: "" if d.get("needle_acc") is None else f"{d['needle_acc']:.2f} ± {d['needle_acc_se']:.2f}"  # noqa: E731
        lines.append(f"| {e['cell']} | {e['train_steps']} | {acc(i)} | {acc(r)} | {f(i.get('dll_vs_dense'), '{:+.4f}')} "
                     f"| {f(r.get('dll_vs_dense'), '{:+.4f}')} | {f(i.get('recall'))} | {f(r.get('recall'))} |")
    note = ""
    if entries:
        e = entries[0]
        note = (f"\nctx {e['ctx']}; needle accuracy over {e['n_needles']} trials per cell (± binomial standard error), "
                f"Δ log-lik and recall over the tail of {e['n_docs']} held-out rows.\n")
    return head + "\n".join(lines) + "\n" + note


def plot(entries: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = sorted({e["block_size"] for e in entries})
    topks = sorted({e["topk"] for e in entries})
    cells = {e["cell"]: e for e in entries}
    panels = [("needle accuracy", "needle_acc", "{:.2f}", "viridis"),
              ("Δ log-lik vs dense (tail)", "dll_vs_dense", "{:+.3f}", "RdBu"),
              ("attention-mass recall (tail)", "recall", "{:.3f}", "viridis")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for row, name in enumerate(("inference", "retrained")):
        for ax, (title, key, fmt, cmap) in zip(axes[row], panels):
            g = bt._grid(cells, lambda e: e.get(name, {}).get(key), blocks, topks)
            bt._heatmap(ax, g, blocks, topks, f"{title}: {name.replace('inference', 'inference-only')}", fmt, cmap)
    fig.suptitle(f"MSA block x top-k, shipped indexer vs retrained per block size, ctx {entries[0]['ctx']}")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def report(out: Path, plots: Path, setup_id: str | None = None) -> list[Path]:
    """side_by_side.json / .md in ``out`` and the heatmaps in ``plots`` (the latest setup by default)."""
    own = bt.read_rows(out / RESULTS_FILE)
    setup_id = setup_id or bt.latest_setup([r for r in own if r.get("indexer") == "retrained"])
    entries = side_by_side(own, setup_id) if setup_id else []
    if not entries:
        print("no retrained cell recorded yet", flush=True)
        return []
    written = [out / "side_by_side.json", out / "side_by_side.md", plots / "retrained_vs_inference.png"]
    written[0].write_text(json.dumps({"setup_id": setup_id, "written": datetime.datetime.now().isoformat(
        timespec="seconds"), "cells": entries}, indent=1))
    written[1].write_text(table_markdown(entries))
    plot(entries, written[2])
    for p in written:
        print("wrote", p, flush=True)
    return written


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_eval_arguments(ap)
    ap.add_argument("--cells", choices=["cross", "full"], default="cross",
                    help="cross: the native block's row and top-k's column; full: the whole grid")
    ap.add_argument("--blocks", type=int, nargs="+", default=list(sweep.BLOCKS))
    ap.add_argument("--topks", type=int, nargs="+", default=list(sweep.TOPKS))
    ap.add_argument("--steps", type=int, default=150, help="training steps per block size (the fixed budget)")
    ap.add_argument("--train-seconds", type=float, default=240.0,
                    help="cap on one training's loop (m3jax.train --stop-after; 0 = none); the steps done are recorded")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--data-mb", type=float, default=32.0, help="training text read from the stdlib sources (MB)")
    ap.add_argument("--attention-impl", default="auto", choices=tr.ATTENTION_IMPLS, help="training's attention path")
    ap.add_argument("--train-dtype", default="bfloat16", choices=tr.DTYPES, help="training's compute dtype")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no training or cell after this many seconds (finished work is kept; rerun to continue)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--plots", default=str(HERE / "plots"))
    ap.add_argument("--runs", default="benchmarks/out/retrained_runs", help="training run folders (one per block size)")
    ap.add_argument("--report", action="store_true", help="side-by-side table and plot from --out only")
    args = ap.parse_args(argv)
    sweep.settle_eval_defaults(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        report(Path(args.out), Path(args.plots))
        return 0
    rows = run(args)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
