"""Long-context quality of the shipped m3-small: held-out perplexity with MSA vs with every layer
dense, and the attention-mass recall of its trained indexer vs an untrained one, at 4K-16K tokens.

    python experiments/2026-11-29_m3_small/eval_long.py [--ctx 4096 8192 16384] [--docs 4]

Documents: the held-out standard-library files (m3jax.data.stdlib_files), tokenized with the
checkpoint's tokenizer and concatenated into --docs windows of ctx tokens. NLL is averaged over the
second half of each window, where every MSA query sees far more than top-k x block tokens. Writes
results/long_context.json and prints a markdown table.
"""

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import m3jax
from m3jax.data import stdlib_files
from m3jax.generate import DEFAULT_CHECKPOINT
from m3jax.probe import probe, with_dense_layers
from m3jax.train import init_train_params, with_index_branch

HERE = Path(__file__).parent


@jax.jit
def _nll_rows(logits, targets):
    logz = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logits.astype(jnp.float32), targets[..., None], -1)[..., 0]
    return logz - picked


def windows(tokenizer_path: Path, ctx: int, n: int) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    _, held, _ = stdlib_files()
    ids = []
    for f in held:
        ids.extend(tok.encode(f.read_text(encoding="utf-8", errors="replace")).ids + [2])
    ids = np.asarray(ids, np.int32)
    n = min(n, (len(ids) - 1) // ctx)
    if n == 0:
        raise SystemExit(f"held-out corpus has {len(ids)} tokens < ctx {ctx}")
    starts = np.linspace(0, len(ids) - ctx - 1, n).astype(int)
    return np.stack([ids[s : s + ctx + 1] for s in starts])


def nll_second_half(model, rows: np.ndarray) -> float:
    vals = []
    for r in rows:
        logits = m3jax.forward(model, r[None, :-1]).logits
        nll = np.asarray(_nll_rows(logits, jnp.asarray(r[None, 1:])))[0]
        vals.append(nll[len(nll) // 2 :].mean())
    return float(np.mean(vals))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "long_context.json")
    args = ap.parse_args(argv)
    model = m3jax.load_pretrained(args.checkpoint, dtype="float32", progress=False)
    cfg = model.config.replace(attention_chunk=2048)
    model = m3jax.M3Model(cfg, model.params)
    sparse = [i for i in range(cfg.text.num_hidden_layers) if cfg.text.is_sparse_attention(i)]
    dense = m3jax.M3Model(with_dense_layers(cfg, sparse), model.params)
    fresh = init_train_params(cfg, seed=1)["text"]["layers"]
    untrained = m3jax.M3Model(cfg, with_index_branch(model.params, [fl.get("index") for fl in fresh]))
    out = []
    for ctx in args.ctx:
        t0 = time.time()
        rows = windows(args.checkpoint / "tokenizer.json", ctx, args.docs)
        r = {"ctx": ctx, "docs": len(rows), "nll_msa": nll_second_half(model, rows),
             "nll_dense": nll_second_half(dense, rows), "nll_msa_untrained_index": nll_second_half(untrained, rows)}
        probe_ids = rows[:1, :-1]
        for name, m in (("recall_trained_index", model), ("recall_untrained_index", untrained)):
            r[name] = float(np.mean([s["recall_mean"] for s in probe(m, probe_ids, query_chunk=1024).summary()]))
        r["seconds"] = round(time.time() - t0, 1)
        out.append(r)
        print(json.dumps(r), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"checkpoint": str(args.checkpoint), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d")}
    args.out.write_text(json.dumps({"meta": meta, "rows": out}, indent=1))
    print("| ctx | ppl MSA | ppl dense | ppl MSA, untrained indexer | recall trained | recall untrained |")
    print("|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['ctx']} | {np.exp(r['nll_msa']):.2f} | {np.exp(r['nll_dense']):.2f} | "
              f"{np.exp(r['nll_msa_untrained_index']):.2f} | {r['recall_trained_index']:.3f} | {r['recall_untrained_index']:.3f} |")


if __name__ == "__main__":
    main()
