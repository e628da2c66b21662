"""MSA block size x top-k: quality against dense attention on held-out long documents, and the speed
of the whole MSA step at M3 shapes. See README.md beside this file for the hypothesis and the runs.

    # quality on GPU (whole grid + equal-budget cut + dense baseline), then the plots
    python experiments/2026-11-29_block_topk/sweep.py --checkpoint m3jax/assets/m3-small --ctx 8192
    python experiments/2026-11-29_block_topk/sweep.py --speed            # 128K context, M3 shapes
    python experiments/2026-11-29_block_topk/sweep.py --plot
    # CPU smoke run (tiny random model when --checkpoint is left out; interpret-mode kernels)
    python experiments/2026-11-29_block_topk/sweep.py --quick --out /tmp/bt
    python experiments/2026-11-29_block_topk/sweep.py --speed --dry --out /tmp/bt

Several hosts: the same command on every process with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or under SLURM / Open MPI, detected), the quality sweep on one mesh over every
process's devices; process 0 prints and writes the results, and the rows are compared across the
processes at the end (m3jax.distributed).

Every finished cell is one JSON line in ``<out>/quality.jsonl`` / ``<out>/speed.jsonl``, keyed by
(setup id, cell); a rerun with the same setup skips finished cells, so an interrupted sweep resumes.
A cell that raised is written with ``error`` and retried on the next run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import m3jax
from m3jax import cli, distributed
from m3jax.needle import heldout_stream
from m3jax.probe import probe

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = HERE / "results"
PLOTS = HERE / "plots"

BLOCKS, TOPKS, BUDGET = (32, 64, 128, 256), (4, 8, 16, 32, 64), 512
QUICK_BLOCKS, QUICK_TOPKS, QUICK_BUDGET = (32, 64), (2, 4), 128
DENSE = "dense"
VALUE_CHARS = "abcdefghjkmnpqrstuvwxyz23456789"  # needle values: no look-alike characters


# --------------------------------------------------------------------------------------------------
# Cells


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str
    block_size: int | None  # None: the checkpoint's own block size (dense baseline)
    topk: int | None  # None: dense (top-k = every block)

    @property
    def budget(self) -> int | None:
        return None if self.topk is None else self.block_size * self.topk


def cell_name(block_size: int, topk: int) -> str:
    return f"b{block_size}_k{topk}"


def grid_cells(blocks=BLOCKS, topks=TOPKS, budget=BUDGET) -> list[Cell]:
    """Dense baseline, then the block x top-k grid, then the equal-budget cut (block x top-k = budget)."""
    pairs = [(b, k) for b in blocks for k in topks]
    pairs += [(b, budget // b) for b in blocks if budget % b == 0 and budget // b >= 1]
    cells, seen = [Cell(DENSE, None, None)], set()
    for b, k in pairs:
        if (b, k) not in seen:
            seen.add((b, k))
            cells.append(Cell(cell_name(b, k), b, k))
    return cells


def cell_model(model, cell: Cell, ctx: int):
    """The model with the cell's MSA knobs. Dense = top-k covering every block at the native block
    size: each MSA layer then attends to every causal key, i.e. exactly the with_dense_layers model
    (tests/test_sweep.py checks this), and the probe measures recall 1 / error 0 for real."""
    t = model.config.text
    bs = cell.block_size or t.index_block_size
    topk = cell.topk or max(-(-ctx // bs), t.index_local_blocks + t.index_init_blocks)
    cfg = model.config.replace_text(index_block_size=bs, index_topk_blocks=topk)
    return m3jax.M3Model(cfg, model.params, model.mesh)


# --------------------------------------------------------------------------------------------------
# Data: held-out long documents and needles


def _load_tokenizer(ckpt: Path | None):
    if ckpt is None or not (ckpt / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def random_stream(vocab: int, n_tokens: int, seed: int, avoid=()) -> np.ndarray:
    """Token-id mode (no tokenizer.json): uniform ids >= 3 (0, 1, 2 are <pad>, <s>, </s>), with the
    ``avoid`` ids (image / video placeholders) replaced by 3."""
    return _avoid(np.random.default_rng([seed, 1]).integers(3, vocab, n_tokens), avoid)


def _avoid(ids: np.ndarray, avoid) -> np.ndarray:
    return np.where(np.isin(ids, list(avoid)), 3, ids).astype(np.int32)


def media_ids(cfg) -> tuple[int, int]:
    """Image / video placeholder ids: never emitted as text tokens."""
    return cfg.image_token_id, cfg.video_token_id


@dataclasses.dataclass
class Needle:
    with_needle: np.ndarray  # int32 [ctx]: haystack, needle line planted at ``at``, query + value at the end
    control: np.ndarray  # int32 [ctx]: the same haystack without the needle, same query + value at the end
    value: np.ndarray  # int32 [v] value tokens (the last v tokens of both rows)
    value_at: int  # position of the needle's first value token in ``with_needle``


def make_needle(hay: np.ndarray, ctx: int, depth: float, rng, tok, vocab: int, avoid=()) -> Needle:
    """Plant ``\\nSECRET_<4 digits> = "<4 chars>"\\n`` at ``depth`` of the context and end the row with
    ``\\nSECRET_<same digits> = "<value>``. Token-id mode: key = 3 random ids + 1 fixed id, value = 4 ids."""
    if tok is not None:
        key = f"SECRET_{rng.integers(1000, 10000)}"
        value = "".join(rng.choice(list(VALUE_CHARS), 4))
        enc = lambda s: np.asarray(tok.encode(s, add_special_tokens=False).ids, np.int32)  # noqa: E731
        prefix, val, close = enc(f'\n{key} = "'), enc(value), enc('"\n')
    else:
        prefix = _avoid(np.append(rng.integers(3, vocab, 3), 3), avoid)
        val, close = _avoid(rng.integers(3, vocab, 4), avoid), np.zeros((0,), np.int32)
    needle, tail = np.concatenate([prefix, val, close]), np.concatenate([prefix, val])
    at = int(depth * ctx)
    rest = ctx - at - len(needle) - len(tail)
    if rest < 1:
        raise ValueError(f"ctx={ctx} too short for a needle at depth {depth}")
    with_needle = np.concatenate([hay[:at], needle, hay[at : at + rest], tail])
    control = np.concatenate([hay[: ctx - len(tail)], tail])
    return Needle(with_needle, control, val, at + len(prefix))


# --------------------------------------------------------------------------------------------------
# Quality of one cell


def _token_logprobs(logits: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log p(ids[:, t+1] | ..t), argmax == ids[:, t+1]) for t < T - 1, from fp32 logits [B, T, V]."""
    lp = jax.nn.log_softmax(jnp.asarray(logits[:, :-1]), axis=-1)
    tgt = jnp.asarray(ids[:, 1:, None])
    ll = jnp.take_along_axis(lp, tgt, -1)[..., 0]
    return np.asarray(ll), np.asarray(jnp.argmax(lp, -1) == tgt[..., 0])


def evaluate_cell(model, docs: np.ndarray, needles: list[Needle], *, tail_start: int, batch: int,
                  query_chunk: int) -> dict:
    """Probe ``model`` on the doc rows and the needle rows (in batches of ``batch`` rows) and reduce.

    docs: int32 [D, ctx]. Metrics over doc rows at positions >= tail_start (where selection matters):
    mean next-token log-likelihood, recall of the dense attention mass and output error per MSA
    layer. Needle rows: value log-likelihood with / without the needle, greedy retrieval, and
    whether the selection at the value-predicting positions contains the needle's value block.
    """
    rows = [docs] + [np.stack([n.with_needle, n.control]) for n in needles]
    rows = np.concatenate(rows).astype(np.int32)
    ctx, n_docs = rows.shape[1], len(docs)
    ll_all, hit_all, layer_recall, layer_err, sel_hits = [], [], {}, {}, []
    bs = model.config.text.index_block_size
    for s in range(0, len(rows), batch):
        ids = rows[s : s + batch]
        res = probe(model, ids, query_chunk=query_chunk, share_compilation=True)
        ll, hit = _token_logprobs(res.logits, ids)
        ll_all.append(ll)
        hit_all.append(hit)
        for i in res.msa_layers:
            p = res.layers[i]
            layer_recall.setdefault(i, []).append(p.recall[:, :, tail_start:])  # [b, N, T']
            layer_err.setdefault(i, []).append(p.output_error[:, tail_start:])
            sel_hits.append((s, i, p.block_indices))
    ll, hit = np.concatenate(ll_all), np.concatenate(hit_all)
    out = {"ll_tail": float(ll[:n_docs, tail_start - 1 :].mean())}
    out["ppl_tail"] = math.exp(-out["ll_tail"])
    if layer_recall:
        rec = {i: np.concatenate(v)[:n_docs] for i, v in layer_recall.items()}
        err = {i: np.concatenate(v)[:n_docs] for i, v in layer_err.items()}
        out["recall_tail"] = float(np.mean([r.mean() for r in rec.values()]))
        out["recall_tail_min_layer"] = float(min(r.mean() for r in rec.values()))
        out["output_error_tail"] = float(np.mean([e.mean() for e in err.values()]))
        out["per_layer"] = {str(i): {"recall_tail": float(rec[i].mean()), "output_error_tail": float(err[i].mean())}
                            for i in rec}
    if needles:
        # Row n_docs + 2j is trial j with the needle, n_docs + 2j + 1 its control; values differ in length.
        preds = [slice(ctx - len(n.value) - 1, ctx - 1) for n in needles]  # logits at t predict token t + 1
        nl = [(ll[n_docs + 2 * j, p].mean(), ll[n_docs + 2 * j + 1, p].mean()) for j, p in enumerate(preds)]
        nh = [(hit[n_docs + 2 * j, p].all(), hit[n_docs + 2 * j + 1, p].all()) for j, p in enumerate(preds)]
        out["needle_ll"] = float(np.mean([a for a, _ in nl]))
        out["needle_ll_control"] = float(np.mean([c for _, c in nl]))
        out["needle_gain"] = out["needle_ll"] - out["needle_ll_control"]
        out["needle_acc"] = float(np.mean([a for a, _ in nh]))
        out["needle_acc_control"] = float(np.mean([c for _, c in nh]))
        hits = []
        for s, _, sel in sel_hits:  # sel: [b, K, T, topk] of rows s .. s + b
            for r in range(sel.shape[0]):
                j, control = divmod(s + r - n_docs, 2)
                if j >= 0 and not control:
                    blk = needles[j].value_at // bs
                    hits.append((sel[r][:, preds[j]] == blk).any(-1).mean())
        if hits:
            out["needle_block_selected"] = float(np.mean(hits))
    return out


# --------------------------------------------------------------------------------------------------
# Results files


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(path: Path, setup_id: str) -> set[str]:
    return {r["cell"] for r in read_rows(path) if r.get("setup_id") == setup_id and "error" not in r}


def _record(out, rows: list, row: dict, t0: float) -> None:
    """A finished (or failed) cell: its time, one line in the results file, one printed line."""
    row["seconds"] = round(time.time() - t0, 2)
    rows.append(row)
    if distributed.is_voice():  # one voice when the sweep runs as several processes
        append_row(out, row)
        print(_fmt_row(row), flush=True)


def append_row(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def _setup_id(setup: dict) -> str:
    return hashlib.sha1(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:12]


def _checkpoint_fingerprint(ckpt: Path | None, preset_name: str, seed: int) -> dict:
    if ckpt is None:
        return {"random_preset": preset_name, "seed": seed}
    files = sorted(p for p in ckpt.iterdir() if p.suffix in (".json", ".safetensors"))
    h = hashlib.sha1()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes() if p.suffix == ".json" else str(p.stat().st_size).encode())
    return {"checkpoint": ckpt.name, "checkpoint_sha1": h.hexdigest()[:12]}


# --------------------------------------------------------------------------------------------------
# Quality sweep


def _mesh(devices: int | None):
    """Mesh over the first ``devices`` visible devices (default all, every process's when the job has
    several); None for one device."""
    n = devices or len(jax.devices())
    if jax.process_count() > 1 and n != len(jax.devices()):
        raise SystemExit(f"--devices {n}: a job of {jax.process_count()} processes runs on all their "
                         f"{len(jax.devices())} devices")
    if n < 2:
        return None
    from m3jax.sharding import make_mesh

    return make_mesh(n)


def run_quality(args) -> list[dict]:
    ckpt = Path(args.checkpoint).resolve() if args.checkpoint else None
    mesh = None if args.no_mesh else _mesh(args.devices)
    if ckpt is not None:
        # the reference path on every device: the dense cell's top-k is beyond the kernels (m3jax.probe
        # takes its selections from the kernels when a model runs attention_impl="pallas")
        model = m3jax.load_pretrained(ckpt, dtype=args.dtype, attention_impl="reference", progress=False, mesh=mesh)
    else:
        model = m3jax.init_random(m3jax.preset(args.preset), seed=args.seed, dtype=args.dtype, mesh=mesh)
    t = model.config.text
    tok = _load_tokenizer(ckpt)
    ctx = args.ctx
    need = (args.n_docs + args.n_needles) * ctx
    eos = t.eos_token_id[0] if isinstance(t.eos_token_id, tuple) else (t.eos_token_id or 2)
    avoid = media_ids(model.config)
    stream = (heldout_stream(lambda text: tok.encode(text, add_special_tokens=False).ids, need, eos) if tok is not None
              else random_stream(t.vocab_size, need, args.seed, avoid))
    docs = np.stack([stream[i * ctx : (i + 1) * ctx] for i in range(args.n_docs)])
    rng = np.random.default_rng(args.seed)
    needles = [make_needle(stream[(args.n_docs + j) * ctx :], ctx, args.needle_depth, rng, tok, t.vocab_size, avoid)
               for j in range(args.n_needles)]
    tail_start = int(ctx * args.tail_start)
    setup = {**_checkpoint_fingerprint(ckpt, args.preset, args.seed), "ctx": ctx, "n_docs": args.n_docs,
             "n_needles": args.n_needles, "needle_depth": args.needle_depth, "tail_start": tail_start,
             "dtype": args.dtype, "seed": args.seed, "data": "stdlib-heldout" if tok is not None else "random-ids"}
    setup_id = _setup_id(setup)
    out = Path(args.out) / "quality.jsonl"
    done = finished(out, setup_id)
    blocks, topks, budget = (QUICK_BLOCKS, QUICK_TOPKS, QUICK_BUDGET) if args.quick else (BLOCKS, TOPKS, BUDGET)
    cells = grid_cells(args.blocks or blocks, args.topks or topks, args.budget or budget)
    todo = [c for c in cells if c.name not in done]
    if distributed.is_voice():
        print(f"quality: setup {setup_id} ({setup}), {len(cells) - len(todo)} of {len(cells)} cells done", flush=True)
    rows = []
    for c in todo:
        t0 = time.time()
        m = cell_model(model, c, ctx)
        row = {"cell": c.name, "setup_id": setup_id, "setup": setup, "block_size": m.config.text.index_block_size,
               "topk": c.topk, "budget": c.budget, "native_block_size": t.index_block_size,
               "native_topk": t.index_topk_blocks, "mesh": None if mesh is None else dict(mesh.shape),
               "time": datetime.datetime.now().isoformat(timespec="seconds")}
        try:
            with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                batch = args.batch or len(docs) + 2 * len(needles)
                row.update(evaluate_cell(m, docs, needles, tail_start=tail_start, batch=batch,
                                         query_chunk=args.query_chunk))
        except Exception as e:  # noqa: BLE001 - one failing cell must not stop the sweep; rerun retries it
            row["error"] = f"{type(e).__name__}: {e}"
        _record(out, rows, row, t0)
    # every process evaluated the same cells on one mesh: their numbers must agree
    distributed.check_same("quality rows", [{k: v for k, v in r.items() if k not in ("time", "seconds")} for r in rows])
    return rows


def _fmt_row(r: dict) -> str:
    keys = ("ll_tail", "recall_tail", "output_error_tail", "needle_acc", "needle_gain", "speedup", "error",
            "unsupported")
    vals = " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys if k in r)
    return f"{r['cell']:>10} ({r.get('seconds', 0):.1f}s) {vals}"


# --------------------------------------------------------------------------------------------------
# Speed sweep (benchmarks/msa_step.py, same process as its dense baseline)


def run_speed(args) -> list[dict]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks import msa_step
    from m3jax.msa.kernels import unsupported_reason as pallas_unsupported_reason

    base = m3jax.preset("minimax_m3").text
    if args.dry:  # smallest shapes the kernels take (GQA group 8, head dims 64), interpret mode off-GPU
        shape = dict(n=16, kh=2, h=64, hx=64)
        base = dataclasses.replace(base, num_attention_heads=16, num_key_value_heads=2, head_dim=64, rotary_dim=64,
                                   index_n_heads=2, index_head_dim=64)
        ctx, chunk, iters = args.speed_ctx or 256, 128, 1
        # block 8: a cell the kernels refuse (blocks are multiples of 16), so the refusal is recorded too
        cells = [Cell(cell_name(b, k), b, k) for b in (8, 64) for k in (2,)]
        dense_impl = "xla"
    else:
        shape = dict(n=msa_step.N, kh=msa_step.K, h=msa_step.H, hx=msa_step.HX)
        ctx, chunk, iters = args.speed_ctx or 131072, args.speed_chunk, 10
        cells = [c for c in grid_cells(args.blocks or BLOCKS, args.topks or TOPKS, args.budget or BUDGET) if c.topk]
        dense_impl = "cudnn"
    dev = jax.devices()[0]
    setup = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "ctx": ctx, "chunk": chunk,
             "dry": bool(args.dry), **shape}
    setup_id = _setup_id(setup)
    out = Path(args.out) / "speed.jsonl"
    done = finished(out, setup_id)
    todo = [c for c in cells if c.name not in done]
    print(f"speed: setup {setup_id} ({setup}), {len(cells) - len(todo)} of {len(cells)} cells done", flush=True)
    if not todo:
        return []
    inputs = msa_step.make_inputs(ctx, chunk, **shape)
    ms_dense = msa_step.time_dense(inputs, implementation=dense_impl, iters=iters)
    rows = []
    for c in todo:
        cfg = dataclasses.replace(base, index_block_size=c.block_size, index_topk_blocks=c.topk)
        row = {"cell": c.name, "setup_id": setup_id, "setup": setup, "block_size": c.block_size, "topk": c.topk,
               "budget": c.budget, "ms_dense": ms_dense, "dense_impl": dense_impl,
               "time": datetime.datetime.now().isoformat(timespec="seconds")}
        t0 = time.time()
        reason = pallas_unsupported_reason(cfg)
        if reason:
            row["unsupported"] = reason
        else:
            try:
                row["ms_msa"] = msa_step.time_msa_step(cfg, inputs, iters=iters)
                row["speedup"] = ms_dense / row["ms_msa"]
            except Exception as e:  # noqa: BLE001 - recorded, retried on the next run
                row["error"] = f"{type(e).__name__}: {e}"
        _record(out, rows, row, t0)
    return rows


# --------------------------------------------------------------------------------------------------
# Plots and the summary table


def latest_setup(rows: list[dict]) -> str | None:
    ok = [r for r in rows if "error" not in r]
    return ok[-1]["setup_id"] if ok else None


def select(rows: list[dict], setup_id: str | None = None) -> dict[str, dict]:
    """{cell: row} of one setup (the most recent one by default), finished cells only."""
    setup_id = setup_id or latest_setup(rows)
    return {r["cell"]: r for r in rows if r.get("setup_id") == setup_id and "error" not in r}


def _grid(cells: dict[str, dict], key, blocks, topks) -> np.ndarray:
    g = np.full((len(blocks), len(topks)), np.nan)
    for i, b in enumerate(blocks):
        for j, k in enumerate(topks):
            r = cells.get(cell_name(b, k))
            if r is not None:
                v = key(r)
                g[i, j] = np.nan if v is None else v
    return g


def _heatmap(ax, g, blocks, topks, title, fmt="{:.3f}", cmap="viridis", na=None):
    import matplotlib

    finite = g[np.isfinite(g)]
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    if cmap == "RdBu" and finite.size:  # signed deltas: white at 0
        hi = max(abs(lo), abs(hi), 1e-12)
        lo = -hi
    norm = matplotlib.colors.Normalize(lo, hi if hi > lo else lo + 1e-12)
    cm = matplotlib.colormaps[cmap]
    ax.imshow(np.ma.masked_invalid(g), cmap=cm, norm=norm, aspect="auto")
    ax.set_xticks(range(len(topks)), [str(k) for k in topks])
    ax.set_yticks(range(len(blocks)), [str(b) for b in blocks])
    ax.set(xlabel="top-k blocks", ylabel="block size", title=title)
    for i in range(len(blocks)):
        for j in range(len(topks)):
            v = g[i, j]
            if np.isfinite(v):
                r, gg, b, _ = cm(norm(v))
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                        color="k" if 0.299 * r + 0.587 * gg + 0.114 * b > 0.5 else "w")
            elif na and na[i][j]:
                ax.text(j, i, na[i][j], ha="center", va="center", fontsize=7, color="k")


def _axes_of(cells: dict[str, dict]) -> tuple[list[int], list[int]]:
    rs = [r for r in cells.values() if r.get("topk")]
    return sorted({r["block_size"] for r in rs}), sorted({r["topk"] for r in rs})


def summary_markdown(quality: dict[str, dict], speed: dict[str, dict]) -> str:
    """One table row per cell: block, top-k, tokens, log-lik (delta vs dense), recall, error, needle, speedup."""
    dense = quality.get(DENSE, {})
    head = ("| cell | block | top-k | tokens | ll tail | Δ ll vs dense | ppl | recall | out. error | needle acc "
            "| needle gain | needle block sel. | step speedup |\n" + "|---" * 13 + "|\n")
    f = lambda v, s="{:.4f}": "" if v is None else s.format(v)  # noqa: E731
    lines = []
    order = lambda n: (n != DENSE, quality[n].get("block_size") or 0, quality[n].get("topk") or 0)  # noqa: E731
    for name in sorted(quality, key=order):
        r, s = quality[name], speed.get(name, {})
        d = None if "ll_tail" not in dense else r["ll_tail"] - dense["ll_tail"]
        sp = f(s.get("speedup"), "{:.2f}x") if "speedup" in s else ("n/a" if "unsupported" in s else "")
        lines.append(f"| {name} | {r['block_size']} | {r.get('topk') or 'all'} | {r.get('budget') or 'all'} | "
                     f"{f(r.get('ll_tail'))} | {f(d, '{:+.4f}')} | {f(r.get('ppl_tail'), '{:.2f}')} | "
                     f"{f(r.get('recall_tail'))} | {f(r.get('output_error_tail'))} | "
                     f"{f(r.get('needle_acc'), '{:.2f}')} | "
                     f"{f(r.get('needle_gain'), '{:+.3f}')} | {f(r.get('needle_block_selected'), '{:.2f}')} | {sp} |")
    out = head + "\n".join(lines) + "\n"
    unsupported = {n: r["unsupported"] for n, r in speed.items() if "unsupported" in r}
    if unsupported:
        out += "\nSpeed n/a (the Pallas kernels cannot take the cell): " + "; ".join(
            f"{n}: {why}" for n, why in sorted(unsupported.items())) + "\n"
    return out


def plot(results: Path, plots: Path, setup_id: str | None = None) -> list[Path]:
    """Heatmaps over the grid (Δ log-lik vs dense, recall, output error, needle), the equal-budget cut,
    the speedup heatmap, and summary.md. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    quality = select(read_rows(results / "quality.jsonl"), setup_id)
    speed = select(read_rows(results / "speed.jsonl"))
    written = []
    if quality:
        blocks, topks = _axes_of(quality)
        dense_ll = quality.get(DENSE, {}).get("ll_tail")
        panels = [
            ("Δ log-lik per token vs dense (tail)", lambda r: None if dense_ll is None else r["ll_tail"] - dense_ll,
             "{:+.3f}", "RdBu"),
            ("attention-mass recall (tail)", lambda r: r.get("recall_tail"), "{:.3f}", "viridis"),
            ("output error vs dense (tail)", lambda r: r.get("output_error_tail"), "{:.3f}", "magma_r"),
            ("needle accuracy (greedy)", lambda r: r.get("needle_acc"), "{:.2f}", "viridis"),
            ("needle gain (Δ value log-lik)", lambda r: r.get("needle_gain"), "{:+.2f}", "viridis"),
            ("needle block selected", lambda r: r.get("needle_block_selected"), "{:.2f}", "viridis"),
        ]
        fig, axes = plt.subplots(2, 3, figsize=(15, 8))
        for ax, (title, key, fmt, cmap) in zip(axes.ravel(), panels):
            _heatmap(ax, _grid(quality, key, blocks, topks), blocks, topks, title, fmt, cmap)
        setup = next(iter(quality.values()))["setup"]
        fig.suptitle(f"MSA block x top-k vs dense — {setup.get('checkpoint') or setup.get('random_preset')}, "
                     f"ctx {setup['ctx']}" + (f", dense ll {dense_ll:.4f}" if dense_ll is not None else ""))
        fig.tight_layout()
        written.append(plots / "quality_heatmaps.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

        budget = [r for r in quality.values() if r.get("budget") and r["budget"] == _modal_budget(quality)]
        budget.sort(key=lambda r: r["block_size"])
        if budget:
            fig, ax = plt.subplots(1, 3, figsize=(13, 3.5))
            xs = [r["block_size"] for r in budget]
            lbl = [f"{r['block_size']}x{r['topk']}" for r in budget]
            for a, (title, key) in zip(ax, [("Δ log-lik vs dense", lambda r: r["ll_tail"] - dense_ll if dense_ll is not None else np.nan),
                                            ("recall / output error", None), ("needle", None)]):
                if key is not None:
                    a.plot(xs, [key(r) for r in budget], "o-")
                elif title.startswith("recall"):
                    a.plot(xs, [r.get("recall_tail", np.nan) for r in budget], "o-", label="recall")
                    a.plot(xs, [r.get("output_error_tail", np.nan) for r in budget], "s--", label="output error")
                    a.legend()
                else:
                    a.plot(xs, [r.get("needle_acc", np.nan) for r in budget], "o-", label="accuracy")
                    a.plot(xs, [r.get("needle_block_selected", np.nan) for r in budget], "s--", label="block selected")
                    a.legend()
                a.set_xscale("log", base=2)
                a.set_xticks(xs, lbl)
                a.set(title=title, xlabel="block x top-k")
            fig.suptitle(f"equal token budget: block x top-k = {budget[0]['budget']} tokens")
            fig.tight_layout()
            written.append(plots / "equal_budget.png")
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
    if speed:
        blocks, topks = _axes_of(speed)
        g = _grid(speed, lambda r: r.get("speedup"), blocks, topks)
        na = [["n/a" if "unsupported" in speed.get(cell_name(b, k), {}) else "" for k in topks] for b in blocks]
        fig, ax = plt.subplots(figsize=(6, 4))
        _heatmap(ax, g, blocks, topks, "", "{:.3g}x", "viridis", na)
        s = next(iter(speed.values()))["setup"]
        ax.set_title(f"MSA step speedup vs {next(iter(speed.values()))['dense_impl']} dense\n"
                     f"{s['device']}, ctx {s['ctx']}, {s['chunk']} queries, N={s['n']} K={s['kh']} H={s['h']}",
                     fontsize=9)
        fig.tight_layout()
        written.append(plots / "speedup.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    (plots / "summary.md").write_text(summary_markdown(quality, speed))
    written.append(plots / "summary.md")
    return written


def _modal_budget(quality: dict[str, dict]) -> int | None:
    """The budget with the most distinct block sizes (the equal-budget cut)."""
    by = {}
    for r in quality.values():
        if r.get("budget"):
            by.setdefault(r["budget"], set()).add(r["block_size"])
    return max(by, key=lambda b: (len(by[b]), b)) if by else None


# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF-layout M3 checkpoint dir (tokenizer.json optional)")
    ap.add_argument("--preset", default="m3_tiny", help="random model of this preset when --checkpoint is left out")
    ap.add_argument("--out", default=str(RESULTS), help="results directory (quality.jsonl, speed.jsonl)")
    ap.add_argument("--ctx", type=int, default=None, help="tokens per row (default 8192; --quick 512)")
    ap.add_argument("--n-docs", type=int, default=None, help="held-out document rows (default 2; --quick 1)")
    ap.add_argument("--n-needles", type=int, default=None, help="needle trials (default 8; --quick 2)")
    ap.add_argument("--needle-depth", type=float, default=0.1, help="needle position as a fraction of ctx")
    ap.add_argument("--tail-start", type=float, default=0.5, help="metrics over positions >= this fraction of ctx")
    ap.add_argument("--batch", type=int, default=None, help="rows per probe call (0 = all; default 4; --quick 0)")
    ap.add_argument("--query-chunk", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, nargs="+", default=None)
    ap.add_argument("--topks", type=int, nargs="+", default=None)
    ap.add_argument("--budget", type=int, default=None, help="equal-budget cut: block x top-k tokens")
    ap.add_argument("--quick", action="store_true", help="reduced grid and sizes (CPU, CI)")
    ap.add_argument("--no-mesh", action="store_true", help="stay on one device even when several are visible")
    ap.add_argument("--devices", type=int, default=None,
                    help="quality sweep on the first N visible devices (default: all of them; 1 = --no-mesh)")
    ap.add_argument("--speed", action="store_true", help="time the MSA step per cell vs cuDNN dense (GPU)")
    ap.add_argument("--dry", action="store_true", help="--speed at tiny shapes, kernels in interpret mode (CPU)")
    ap.add_argument("--speed-ctx", type=int, default=None, help="speed context (default 131072; --dry 256)")
    ap.add_argument("--speed-chunk", type=int, default=8192, help="queries per timed prefill chunk")
    ap.add_argument("--plot", action="store_true", help="write plots + summary.md from --out into --plots")
    ap.add_argument("--plots", default=str(PLOTS))
    cli.add_distributed_arguments(ap)
    ap.add_argument("--setup", default=None, help="--plot: setup id to show (default: the latest)")
    args = ap.parse_args(argv)
    q = args.quick
    args.ctx = args.ctx or (512 if q else 8192)
    args.n_docs = args.n_docs if args.n_docs is not None else (1 if q else 2)
    args.n_needles = args.n_needles if args.n_needles is not None else (2 if q else 8)
    args.batch = args.batch if args.batch is not None else (0 if q else 4)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed.initialize(args)
    if args.plot and not distributed.is_voice():
        return 0
    if args.plot:
        for p in plot(Path(args.out), Path(args.plots), args.setup):
            print("wrote", p)
        return 0
    rows = run_speed(args) if args.speed else run_quality(args)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
