"""MSA block size x top-k on the retrieval-trained m3-small at 16K: needle accuracy, recall of the dense
attention mass and log-likelihood against dense, per cell. See README.md beside this file.

    python experiments/2026-12-01_block_topk_retrieval/sweep.py --checkpoint DIR --max-seconds 230   # GPU, 16K
    python experiments/2026-12-01_block_topk_retrieval/sweep.py --speed         # GPU: MSA-step speed, 128K
    python experiments/2026-12-01_block_topk_retrieval/sweep.py --plot          # heatmaps + summary.md
    python experiments/2026-12-01_block_topk_retrieval/sweep.py --quick --out /tmp/btr   # CPU smoke run

Everything but the data comes from the 2026-11-29 sweep (``experiments/2026-11-29_block_topk/sweep.py``,
imported): the cells, the per-cell model, the metrics (one ``m3jax.probe`` pass per row batch), the
resumable JSONL records, the speed runner and the plots. What is new is the needle: the
``KEY <k> = <v>`` line of ``m3jax.train --data retrieval`` (the format the model was trained on),
built by :func:`m3jax.needle.needle_row` at several depths, in held-out text, with a control row
(same haystack and query, no needle). Each finished cell is one JSON line in ``<out>/quality.jsonl``
keyed by (setup id, cell): rerunning the same command skips finished cells. Cells run most telling
first (dense, the native cell, the equal-budget cut, then the rest of the grid), and ``--max-seconds``
starts no new cell past that budget, so a call of fixed length gives the most useful partial grid and
the next call continues it.

The model, the evaluation rows and the per-cell evaluation (:func:`load_model`, :func:`eval_set`,
:func:`evaluate`, with their arguments, :func:`add_eval_arguments`) are shared with the retrained
sweep (``experiments/2026-12-05_block_topk_retrained/retrain.py`` imports them), so both score a cell
on the same rows with the same code.

Every cell runs on the jnp reference path whatever the device: the dense cell (top-k over every
block) and top-k above 64 are outside what the kernels take, and one path keeps the cells comparable.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

import m3jax
from m3jax import cli
from m3jax.needle import DEFAULT_CHECKPOINT, heldout_stream, needle_row
from m3jax.data import text_encoder

HERE = Path(__file__).resolve().parent
OLD_SWEEP = HERE.parent / "2026-11-29_block_topk" / "sweep.py"
BLOCKS, TOPKS, BUDGET = (32, 64, 128, 256), (2, 4, 8, 16, 32, 64), 512
QUICK_BLOCKS, QUICK_TOPKS, QUICK_BUDGET = (16, 32), (2, 4), 64
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _load_old_sweep():
    spec = importlib.util.spec_from_file_location("block_topk_sweep", OLD_SWEEP)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


bt = _load_old_sweep()


def make_needles(stream: np.ndarray, ctx: int, n: int, depths, seed: int, encode) -> list:
    """``n`` needle trials (trial i at depths[i % len(depths)]) as the old sweep's ``Needle`` rows."""
    rng = np.random.default_rng([seed, ctx])
    rows = [needle_row(stream, ctx, depths[i % len(depths)], rng, encode) for i in range(n)]
    return [bt.Needle(r.tokens, r.control, r.value, r.value_at) for r in rows]


def cell_order(cells: list, native_block: int, native_topk: int, budget: int) -> list:
    """Dense, the native cell, the equal-budget cut (by block size), then the rest in grid order."""
    def rank(c):
        if c.topk is None:
            return 0
        if (c.block_size, c.topk) == (native_block, native_topk):
            return 1
        return 2 if c.budget == budget else 3
    return sorted(cells, key=rank)  # stable: grid order inside a rank


def load_model(args):
    """(model on the reference path, checkpoint folder or None): ``--checkpoint`` in ``--dtype`` with
    ``--config-override``, or without a checkpoint a tiny random model (CPU smoke runs)."""
    ckpt = Path(args.checkpoint).resolve() if args.checkpoint else None
    if ckpt is not None:
        model = m3jax.load_pretrained(ckpt, dtype=args.dtype, attention_impl="reference", progress=False)
    else:  # CPU smoke run: a tiny random model, UTF-8 bytes as token ids
        cfg = m3jax.preset("m3_tiny")
        model = m3jax.init_random(cfg, seed=args.seed, dtype=args.dtype)
    # text-config fields for every cell (e.g. index_score_dtype=float8_e4m3fn); the reference path runs them all
    return m3jax.M3Model(cli.apply_overrides(model.config, args.config_override), model.params), ckpt


@dataclasses.dataclass
class EvalSet:
    """The rows every cell is scored on: held-out documents [n_docs, ctx], needle trials, the start of
    the scored tail, and the setup that names them (its id keys the results files)."""

    docs: np.ndarray
    needles: list
    tail_start: int
    setup: dict

    @property
    def setup_id(self) -> str:
        return bt._setup_id(self.setup)


def eval_set(model, ckpt: Path | None, args) -> EvalSet:
    """Held-out document rows and needle trials for ``model``'s tokenizer (``ckpt``'s, or bytes)."""
    t = model.config.text
    encode = text_encoder(bt._load_tokenizer(ckpt), t.vocab_size)
    eos = t.eos_token_id[0] if isinstance(t.eos_token_id, tuple) else (t.eos_token_id or 2)
    ctx = args.ctx
    stream = heldout_stream(encode, max((args.n_docs + 2) * ctx, 150_000), eos)
    docs = np.stack([stream[i * ctx : (i + 1) * ctx] for i in range(args.n_docs)])
    needles = make_needles(stream[args.n_docs * ctx :], ctx, args.n_needles, args.depths, args.seed, encode)
    tail_start = int(ctx * args.tail_start)
    setup = {**bt._checkpoint_fingerprint(ckpt, "m3_tiny", args.seed), "ctx": ctx, "n_docs": args.n_docs,
             "n_needles": args.n_needles, "needle": "kv-retrieval", "depths": list(args.depths),
             "tail_start": tail_start, "dtype": args.dtype, "seed": args.seed,
             **({"config_override": args.config_override} if args.config_override else {})}
    return EvalSet(docs, needles, tail_start, setup)


def evaluate(model, cell, evs: EvalSet, args) -> dict:
    """One cell's record: its knobs on ``model`` (:func:`bt.cell_model`), scored on ``evs`` (a failure
    is recorded as ``error``: one failing cell must not stop a sweep; a rerun retries it)."""
    t = model.config.text
    m = bt.cell_model(model, cell, evs.setup["ctx"])
    row = {"cell": cell.name, "setup_id": evs.setup_id, "setup": evs.setup, "block_size": m.config.text.index_block_size,
           "topk": cell.topk, "budget": cell.budget, "native_block_size": t.index_block_size,
           "native_topk": t.index_topk_blocks, "time": datetime.datetime.now().isoformat(timespec="seconds")}
    try:
        row.update(bt.evaluate_cell(m, evs.docs, evs.needles, tail_start=evs.tail_start, batch=args.batch,
                                    query_chunk=args.query_chunk))
    except Exception as e:  # noqa: BLE001 - one failing cell must not stop the sweep; rerun retries it
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def run_quality(args) -> list[dict]:
    t_start = time.time()
    model, ckpt = load_model(args)
    t = model.config.text
    evs = eval_set(model, ckpt, args)
    out = Path(args.out) / "quality.jsonl"
    done = bt.finished(out, evs.setup_id)
    cells = bt.grid_cells(args.blocks, args.topks, args.budget)
    todo = cell_order([c for c in cells if c.name not in done], t.index_block_size, t.index_topk_blocks, args.budget)
    print(f"quality: setup {evs.setup_id} ({evs.setup}), {len(cells) - len(todo)} of {len(cells)} cells done", flush=True)
    rows = []
    for n, c in enumerate(todo):
        if args.max_seconds and time.time() - t_start > args.max_seconds:
            print(f"--max-seconds {args.max_seconds} spent: {len(todo) - n} cells left "
                  f"({', '.join(x.name for x in todo[n:])}); the same command continues", flush=True)
            break
        t0 = time.time()
        bt._record(out, rows, evaluate(model, c, evs, args), t0)
    return rows


def add_eval_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments of :func:`load_model`, :func:`eval_set` and :func:`evaluate` (defaults that depend
    on ``--quick`` are None here: :func:`settle_eval_defaults`)."""
    ap.add_argument("--checkpoint", default=None,
                    help="HF checkpoint (default: the built-in m3-small; --quick: a tiny random model unless given)")
    ap.add_argument("--ctx", type=int, default=None, help="tokens per row (default 16384; --quick 256)")
    ap.add_argument("--n-docs", type=int, default=2, help="held-out document rows (log-likelihood, recall)")
    ap.add_argument("--n-needles", type=int, default=None, help="needle trials (default 10; --quick 2)")
    ap.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS))
    ap.add_argument("--tail-start", type=float, default=0.5, help="doc metrics over positions >= this share of ctx")
    ap.add_argument("--batch", type=int, default=None, help="rows per probe pass (default 2; --quick all)")
    ap.add_argument("--query-chunk", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--config-override", type=cli.parse_overrides, default={}, help=cli.CONFIG_OVERRIDE_HELP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny random model, ctx 256, a 2 x 2 grid (CPU)")


def settle_eval_defaults(args) -> None:
    """The defaults of :func:`add_eval_arguments` that depend on ``--quick``."""
    q = args.quick
    if args.checkpoint is None and not q:
        args.checkpoint = str(DEFAULT_CHECKPOINT)
    args.ctx = args.ctx or (256 if q else 16384)
    args.n_needles = args.n_needles if args.n_needles is not None else (2 if q else 10)
    args.batch = args.batch or (args.n_docs + 2 * args.n_needles if q else 2)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_arguments(ap)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--plots", default=str(HERE / "plots"))
    ap.add_argument("--blocks", type=int, nargs="+", default=None, help="block sizes (default 32 64 128 256)")
    ap.add_argument("--topks", type=int, nargs="+", default=None, help="top-k values (default 2 4 8 16 32 64)")
    ap.add_argument("--budget", type=int, default=None, help="equal-budget cut, block x top-k tokens (0: none)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new cell after this many seconds (finished cells are kept; rerun to continue)")
    ap.add_argument("--speed", action="store_true", help="MSA-step speed per cell vs cuDNN dense, 128K (old sweep's runner)")
    ap.add_argument("--plot", action="store_true", help="plots + summary.md from --out into --plots")
    args = ap.parse_args(argv)
    settle_eval_defaults(args)
    q = args.quick
    blocks, topks, budget = (QUICK_BLOCKS, QUICK_TOPKS, QUICK_BUDGET) if q else (BLOCKS, TOPKS, BUDGET)
    args.blocks, args.topks = args.blocks or blocks, args.topks or topks
    args.budget = budget if args.budget is None else args.budget
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        for p in bt.plot(Path(args.out), Path(args.plots)):
            print("wrote", p)
        return 0
    if args.speed:
        grid = ["--blocks", *map(str, args.blocks), "--topks", *map(str, args.topks), "--budget", str(args.budget)]
        rows = bt.run_speed(bt.parse_args(["--speed", "--out", args.out, *grid]))
    else:
        rows = run_quality(args)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
