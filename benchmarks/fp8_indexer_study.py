"""What the fp8 indexer (``index_score_dtype="float8_e4m3fn"``) does to MSA's selections, against bf16.

Three measurements, each on the jnp reference (CPU is enough):

1. random inputs at M3's index shapes (4 index heads, Hx 128, block 128, top-16, ``--random-tokens``
   tokens): share of rows (query, index head) whose selected block sets are equal, mean Jaccard, and
   how many differing rows are near-ties under :func:`m3jax.msa.compare.fp8_score_bound`;
2. the shipped m3-small on held-out text (``--ctx`` tokens, ``--docs`` rows), probed once per setting
   (each setting's own residual stream): rows equal per MSA layer, and the recall of bf16's selected
   attention mass (dense attention mass inside fp8's selection / inside bf16's);
3. needle accuracy of m3-small at ``--ctx`` with and without fp8 (``--trials`` rows from the held-out
   stream, seed ``--seed``: rows the model never saw).

Writes a section to benchmarks/RESULTS.md (``--results``; ``--no-results`` prints it only)::

    PYTHONPATH=. python benchmarks/fp8_indexer_study.py --ctx 4096 --trials 12
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import m3jax
from m3jax.data import text_encoder
from m3jax.msa import compare, reference
from m3jax.needle import DEFAULT_CHECKPOINT, evaluate as needle_eval, heldout_stream
from m3jax.probe import probe

try:
    from benchmarks.run_info import header, run_info
except ImportError:  # run as a script from benchmarks/
    from run_info import header, run_info

FP8 = "float8_e4m3fn"
HERE = Path(__file__).resolve().parent


def rows_equal(a: np.ndarray, b: np.ndarray) -> float:
    """Share of rows (all axes but the last) whose selected block sets are equal (-1 = padding)."""
    return float((np.sort(a, -1) == np.sort(b, -1)).all(-1).mean())


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Mean |A ∩ B| / |A ∪ B| over rows of valid (>= 0) block ids."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    hit = ((a2[:, :, None] == b2[:, None, :]) & (a2[:, :, None] >= 0)).any(-1).sum(-1)
    union = (a2 >= 0).sum(-1) + (b2 >= 0).sum(-1) - hit
    return float(np.mean(hit / np.maximum(union, 1)))


@functools.partial(jax.jit, static_argnames=("block", "topk"))
def _chunk_selections(iq, ik, q_pos, *, block: int, topk: int):
    sel = {}
    scores = {}
    for name in ("bfloat16", FP8):
        scores[name] = reference.block_scores(iq, ik, q_pos, block, score_dtype=name)
        sel[name] = reference.select_blocks(scores[name], q_pos, block_size=block, topk=topk)
    scale = reference.block_scores(jnp.abs(iq), jnp.abs(ik), q_pos, block)
    scale = jnp.max(jnp.where(jnp.isfinite(scale), scale, 0.0), -1)
    return sel["bfloat16"], sel[FP8], scores["bfloat16"], scale


def random_m3_shapes(tokens: int, seeds: list[int], *, heads: int = 4, hx: int = 128, block: int = 128,
                     topk: int = 16, chunk: int = 512) -> dict:
    """Random index queries/keys (normal, as RMS-normed vectors are) at M3's index shapes: selections
    of the rows whose query sees more than ``topk`` blocks (fewer: both select everything)."""
    equal, jac, differing, inside, rows = [], [], 0, 0, 0
    for seed in seeds:
        rng = np.random.default_rng(seed)
        iq = jnp.asarray(rng.normal(0, 1, (1, tokens, heads, hx)), jnp.bfloat16)
        ik = jnp.asarray(rng.normal(0, 1, (1, tokens, hx)), jnp.bfloat16)
        first = topk * block  # first query that sees more than topk blocks
        for c0 in range(first, tokens, chunk):
            q_pos = jnp.arange(c0, min(c0 + chunk, tokens), dtype=jnp.int32)[None]
            s16, s8, sc16, scale = _chunk_selections(iq[:, c0:c0 + q_pos.shape[1]], ik, q_pos, block=block, topk=topk)
            s16, s8 = np.asarray(s16), np.asarray(s8)
            equal.append(rows_equal(s16, s8) * s16[..., 0].size)
            jac.append(jaccard(s16, s8) * s16[..., 0].size)
            d = compare.compare_selections(s8, s16, sc16, q_pos, block, scale, compare.fp8_score_bound(hx))
            differing, inside, rows = differing + d.differing, inside + d.inside_bound, rows + d.rows
    return {"tokens": tokens, "seeds": seeds, "rows": rows, "rows_equal": sum(equal) / rows,
            "jaccard": sum(jac) / rows, "differing": differing, "differing_near_ties": inside,
            "heads": heads, "hx": hx, "block": block, "topk": topk}


def m3_small(ctx: int, docs: int, trials: int, seed: int, dtype: str, query_chunk: int) -> dict:
    model = m3jax.load_pretrained(DEFAULT_CHECKPOINT, dtype=dtype, attention_impl="reference", progress=False)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    t = model.config.text
    encode = text_encoder(tok, t.vocab_size)
    eos = t.eos_token_id[0] if isinstance(t.eos_token_id, tuple) else (t.eos_token_id or 2)
    stream = heldout_stream(encode, max((docs + 2) * ctx, 150_000), eos)
    rows = np.stack([stream[i * ctx:(i + 1) * ctx] for i in range(docs)])
    models = {"bfloat16": model, FP8: m3jax.M3Model(model.config.replace_text(index_score_dtype=FP8), model.params)}
    out = {"ctx": ctx, "docs": docs, "dtype": dtype, "block": t.index_block_size, "topk": t.index_topk_blocks}
    sels, recall = {}, {}
    for name, m in models.items():
        t0 = time.time()
        p = probe(m, rows, query_chunk=query_chunk, share_compilation=True)
        sels[name] = {i: p.layers[i].block_indices for i in p.msa_layers}
        recall[name] = {i: float(np.mean(p.layers[i].recall)) for i in p.msa_layers}
        n = needle_eval(m, encode, stream[docs * ctx:], ctx=ctx, trials=trials, seed=seed, batch=1)
        out[name] = {"needle_accuracy": n["accuracy"], "needle_value_logprob": n["value_logprob"],
                     "needle_block_selected": n["needle_block_selected"], "seconds": round(time.time() - t0, 1)}
    layers = sorted(sels["bfloat16"])
    out["layers"] = [{
        "layer": i, "rows_equal": rows_equal(sels["bfloat16"][i], sels[FP8][i]),
        "jaccard": jaccard(sels["bfloat16"][i], sels[FP8][i]),
        "recall_bf16": recall["bfloat16"][i], "recall_fp8": recall[FP8][i],
        "recall_ratio": recall[FP8][i] / recall["bfloat16"][i],
    } for i in layers]
    out["needle"] = {"trials": trials, "seed": seed}
    return out


def section(info: dict, rnd: dict, small: dict) -> str:
    r, s = rnd, small
    lines = [f"## fp8 indexer against bf16 selections — {info['date'][:10]}, CPU, jax {info['jax']}", "",
             header(info), "",
             "`index_score_dtype=\"float8_e4m3fn\"`: index queries per row and keys per token quantised to e4m3 "
             "with amax/448 scales, fp8 x fp8 products summed in fp32 and rescaled (the jnp reference).", "",
             f"Random inputs at M3's index shapes ({r['heads']} index heads, Hx {r['hx']}, block {r['block']}, "
             f"top-{r['topk']}, {r['tokens']} tokens, seeds {r['seeds']}; the {r['rows']} rows whose query sees more "
             f"than {r['topk']} blocks): rows equal **{r['rows_equal']:.4f}**, mean Jaccard {r['jaccard']:.4f}; "
             f"{r['differing']} differing rows, {r['differing_near_ties']} of them near-ties under "
             "`compare.fp8_score_bound`.", "",
             f"m3-small (shipped; block {s['block']}, top-{s['topk']}, {s['dtype']}) on {s['docs']} held-out row(s) of "
             f"{s['ctx']} tokens, one probe per setting (each on its own residual stream). Recall ratio: dense "
             "attention mass inside fp8's selection / inside bf16's.", "",
             "| MSA layer | rows equal | Jaccard | recall bf16 | recall fp8 | recall ratio |", "|---|---|---|---|---|---|"]
    for row in s["layers"]:
        lines.append(f"| {row['layer']} | {row['rows_equal']:.4f} | {row['jaccard']:.4f} | {row['recall_bf16']:.4f} | "
                     f"{row['recall_fp8']:.4f} | {row['recall_ratio']:.4f} |")
    mean = lambda k: np.mean([row[k] for row in s["layers"]])  # noqa: E731
    lines.append(f"| mean | {mean('rows_equal'):.4f} | {mean('jaccard'):.4f} | {mean('recall_bf16'):.4f} | "
                 f"{mean('recall_fp8'):.4f} | {mean('recall_ratio'):.4f} |")
    lines += ["", f"Needle at {s['ctx']} tokens ({s['needle']['trials']} held-out rows, seed {s['needle']['seed']}): "
              f"bf16 **{s['bfloat16']['needle_accuracy']:.3f}** (value log-prob {s['bfloat16']['needle_value_logprob']:.3f}), "
              f"fp8 **{s[FP8]['needle_accuracy']:.3f}** ({s[FP8]['needle_value_logprob']:.3f}).", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random-tokens", type=int, default=4096)
    ap.add_argument("--random-seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--ctx", type=int, default=4096, help="m3-small probe and needle context")
    ap.add_argument("--docs", type=int, default=1, help="held-out rows for rows equal and recall")
    ap.add_argument("--trials", type=int, default=12, help="needle rows per setting")
    ap.add_argument("--seed", type=int, default=1, help="needle rows' seed")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--query-chunk", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--no-results", action="store_true", help="print the section, do not append it")
    args = ap.parse_args(argv)
    info = run_info("fp8_indexer_study.py", argv)
    t0 = time.time()
    rnd = random_m3_shapes(args.random_tokens, args.random_seeds)
    print(json.dumps(rnd), flush=True)
    small = m3_small(args.ctx, args.docs, args.trials, args.seed, args.dtype, args.query_chunk)
    print(json.dumps(small), flush=True)
    text = section(info, rnd, small)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"info": info, "random": rnd, "m3_small": small,
                                         "seconds": round(time.time() - t0, 1)}, indent=1))
    if not args.no_results:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
