"""Needle retrieval on held-out text: does the model find a key/value line planted far back?

    python -m m3jax.needle --ctx 4096 --trials 10 --seed 0 --output-json needle.json
    python -m m3jax.needle --checkpoint DIR --ctx 16384 --depths 0.1 0.5 0.9 --config-override block=128,topk=4
    python -m m3jax.needle --ctx 16384 --dense            # every MSA layer dense: the retrieval ceiling

A trial is one row of ``--ctx`` tokens: a window of held-out standard-library source (the files
``m3jax.data.stdlib_files`` holds out, never trained on) with the line ``\\nKEY <k> = <v>\\n``
planted at a depth (share of the row before it) and the row ending in ``\\nKEY <k> = <v>``: the
format of ``m3jax.train``'s ``--data retrieval`` (same :func:`m3jax.data.kv_line`). The seed
decides the keys, values, haystack windows and (without ``--depths``) the depths.

A trial is correct when greedy decoding reproduces the value. That is checked in one forward pass
over the whole row, teacher-forced: every value token is the argmax of the logits at the position
before it (greedy decoding emits the value exactly when this holds, so no generation loop is needed).
The MSA selections at those positions (``m3jax.forward(..., return_block_indices=True)``) say, per
MSA layer, how often the block holding the needle's first value token was selected (share over KV
groups, value-predicting positions and trials).

JSON (``--output-json``): ``accuracy``, ``per_depth`` ({depth: {accuracy, trials}}; bins of 0.1 when
the depths are random), ``value_logprob`` (mean log-probability of a value token), ``needle_block_selected``
({MSA layer: share}; null when every layer is dense), ``trials_detail``, and the run's settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import m3jax
from m3jax import cli
from m3jax.atomic import atomic_write
from m3jax.config import load_config
from m3jax.data import KEY_RANGE, draw_keys, kv_line, plant, stdlib_files, text_encoder
from m3jax.probe import with_dense_layers

DEFAULT_CHECKPOINT = Path(__file__).parent / "assets" / "m3-small"


# --------------------------------------------------------------------------------------------------
# Held-out text and needle rows


def heldout_stream(encode, n_tokens: int, eos_id: int) -> np.ndarray:
    """Held-out stdlib files (:func:`m3jax.data.stdlib_files`), longest first, encoded and joined with
    </s> until ``n_tokens`` are there (the stream repeats when the held-out set is shorter)."""
    _, held, _ = stdlib_files()
    parts, total = [], 0
    for f in sorted(held, key=lambda f: (-f.stat().st_size, f.as_posix())):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = np.append(encode(text), np.int32(eos_id)).astype(np.int32)
        parts.append(ids)
        total += len(ids)
        if total >= n_tokens:
            break
    stream = np.concatenate(parts)
    return np.resize(stream, max(n_tokens, len(stream)))


@dataclasses.dataclass
class NeedleRow:
    tokens: np.ndarray  # int32 [ctx]: haystack with the needle line, ending in the query and its value
    value: np.ndarray  # int32 [v]: the value tokens (the row's last v tokens)
    value_at: int  # row position of the needle's first value token
    control: np.ndarray  # int32 [ctx]: the same haystack without the needle line, same ending
    depth: float
    key: str
    secret: int


def needle_row(stream: np.ndarray, ctx: int, depth: float, rng, encode) -> NeedleRow:
    """Plant ``\\nKEY k = v\\n`` at ``depth`` of a random window of ``stream`` and end the row with
    ``\\nKEY k = v`` (k a random key of :func:`m3jax.data.draw_keys`, v a random 5-digit number)."""
    key, secret = draw_keys(rng, encode, 1)[0], int(rng.integers(*KEY_RANGE))
    prefix, value, close = kv_line(encode, key, secret)
    line, query = np.concatenate([prefix, value, close]), np.concatenate([prefix, value])
    m = ctx - len(line) - len(query)
    if m < 1:  # a UsageError is a ValueError: the CLI prints it as one line (--ctx), a caller catches ValueError
        raise cli.UsageError(f"ctx={ctx} is too short for a needle line and its query ({len(line) + len(query)} tokens)")
    start = int(rng.integers(0, len(stream) - m - len(line) + 1))
    tokens, _, (at,) = plant(stream[start : start + m], [(int(round(depth * m)), line, np.zeros(len(line), bool))])
    control = np.concatenate([stream[start : start + m + len(line)], query])
    return NeedleRow(np.concatenate([tokens, query]), value, at + len(prefix), control, depth, key, secret)


@dataclasses.dataclass
class MultiNeedleRow:
    tokens: np.ndarray  # int32 [ctx]: haystack with one needle line per depth, then every query in turn
    keys: list[str]
    secrets: list[int]
    depths: list[float]
    value_at: list[int]  # row position of each needle's first value token
    query_value_at: list[int]  # row position of each query's first value token
    value_len: list[int]


def multi_needle_row(stream: np.ndarray, ctx: int, depths, rng, encode) -> MultiNeedleRow:
    """One row holding a ``\\nKEY k = v\\n`` line per depth (distinct keys) in a random window of
    ``stream``, ending with the queries ``\\nKEY k = v`` of all of them in the needles' order: one long
    forward pass checks retrieval from several distances (the long-context probe's row)."""
    keys = draw_keys(rng, encode, len(depths))
    secrets = [int(x) for x in rng.integers(*KEY_RANGE, len(depths))]
    parts = [kv_line(encode, k, v) for k, v in zip(keys, secrets)]
    lines = [np.concatenate(x) for x in parts]
    queries = [np.concatenate(x[:2]) for x in parts]
    m = ctx - sum(map(len, lines)) - sum(map(len, queries))
    if m < 1:
        raise ValueError(f"ctx={ctx} is too short for {len(depths)} needle lines and their queries")
    start = int(rng.integers(0, len(stream) - m + 1))
    events = [(int(round(d * m)), ln, np.zeros(len(ln), bool)) for d, ln in zip(depths, lines)]
    hay, _, at = plant(stream[start : start + m], events)
    ends = np.cumsum([0] + [len(q) for q in queries])
    return MultiNeedleRow(
        np.concatenate([hay, *queries]), keys, secrets, list(depths), [a + len(x[0]) for a, x in zip(at, parts)],
        [int(len(hay) + e + len(x[0])) for e, x in zip(ends, parts)], [len(x[1]) for x in parts])


def _depth_label(depth: float, given: bool) -> str:
    if given:
        return f"{depth:g}"
    lo = min(int(depth * 10), 9) / 10
    return f"{lo:.1f}-{lo + 0.1:.1f}"


# --------------------------------------------------------------------------------------------------
# Evaluation


def evaluate(model, encode, stream: np.ndarray, *, ctx: int, trials: int, seed: int = 0,
             depths: list[float] | None = None, batch: int = 4) -> dict:
    """Needle accuracy of ``model`` (an :class:`m3jax.M3Model`) over ``trials`` rows of ``ctx`` tokens
    cut from ``stream`` (held-out text). ``depths``: trial i uses depths[i % len(depths)]; None draws
    each depth uniformly from [0, 1) with the seed. Rows go through ``m3jax.forward`` ``batch`` at a
    time (the last batch padded with copies, so one compilation serves every batch)."""
    rng = np.random.default_rng([seed, ctx])
    given = depths is not None
    ds = [depths[i % len(depths)] for i in range(trials)] if given else rng.random(trials).tolist()
    rows = [needle_row(stream, ctx, d, rng, encode) for d in ds]
    t = model.config.text
    bs = t.index_block_size
    correct, logprob, selected = [], [], {}
    for s in range(0, trials, batch):
        chunk = rows[s : s + batch]
        ids = np.stack([r.tokens for r in chunk] + [chunk[-1].tokens] * (batch - len(chunk)))
        out = m3jax.forward(model, ids, return_block_indices=True)
        for j, r in enumerate(chunk):
            pred = np.arange(ctx - len(r.value) - 1, ctx - 1)  # logits at p predict token p + 1
            lp = jax.nn.log_softmax(jnp.asarray(out.logits[j, pred]), axis=-1)
            correct.append(bool((np.asarray(jnp.argmax(lp, -1)) == r.value).all()))
            logprob.append(float(np.asarray(jnp.take_along_axis(lp, jnp.asarray(r.value)[:, None], -1)).mean()))
            for layer, sel in (out.block_indices or {}).items():
                hit = (np.asarray(sel[j][:, pred]) == r.value_at // bs).any(-1)  # [K, v]
                selected.setdefault(int(layer), []).append(float(hit.mean()))
    per_depth: dict[str, list[bool]] = {}
    for r, c in zip(rows, correct):
        per_depth.setdefault(_depth_label(r.depth, given), []).append(c)
    return {
        "ctx": ctx, "trials": trials, "seed": seed,
        "accuracy": float(np.mean(correct)),
        "per_depth": {k: {"accuracy": float(np.mean(v)), "trials": len(v)} for k, v in sorted(per_depth.items())},
        "value_logprob": float(np.mean(logprob)),
        "needle_block_selected": {str(k): float(np.mean(v)) for k, v in sorted(selected.items())} or None,
        "block_size": bs, "topk": t.index_topk_blocks,
        "trials_detail": [{"depth": r.depth, "key": r.key, "value": r.secret, "value_at": r.value_at, "correct": c}
                          for r, c in zip(rows, correct)],
    }


# --------------------------------------------------------------------------------------------------
# CLI


def depth_value(text: str) -> float:
    value = cli.finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a depth is a share of the row in [0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m m3jax.needle", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                    help="HF-layout checkpoint dir (default: the built-in m3-small); its tokenizer.json encodes the "
                         "text (none: UTF-8 bytes as ids)")
    ap.add_argument("--ctx", type=cli.positive_int, default=4096, help="tokens per trial row")
    ap.add_argument("--trials", type=cli.positive_int, default=10)
    ap.add_argument("--seed", type=cli.seed, default=0)
    ap.add_argument("--depths", type=depth_value, nargs="+", default=None,
                    help="needle depths (shares of the row); trials cycle through them. Default: random per trial")
    ap.add_argument("--attention-impl", choices=["auto", "reference", "dense_mask", "pallas"], default="auto")
    ap.add_argument("--config-override", type=cli.parse_overrides, default={}, help=cli.CONFIG_OVERRIDE_HELP)
    ap.add_argument("--dense", action="store_true", help="every MSA layer runs dense causal attention")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch", type=cli.positive_int, default=2, help="rows per forward pass")
    ap.add_argument("--output-json", type=cli.writable_file, default=None)
    cli.add_debug_flag(ap)
    return ap


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    cli.refuse_overwriting_inputs(args.output_json, "--output-json", {"--checkpoint": args.checkpoint})
    if not (args.checkpoint / "config.json").exists():
        raise FileNotFoundError(f"--checkpoint {args.checkpoint}: no config.json there")

    t0 = time.time()
    # the attention path is resolved once, for the overridden config (the kernels may refuse it)
    cfg = cli.apply_overrides(load_config(args.checkpoint), args.config_override)
    cfg = cfg.replace(attention_impl=m3jax.api.resolve_attention_impl(args.attention_impl, cfg, args.dtype))
    if args.dense:
        cfg = with_dense_layers(cfg, [i for i in range(cfg.text.num_hidden_layers) if cfg.text.is_sparse_attention(i)])
    model = m3jax.load_pretrained(args.checkpoint, dtype=args.dtype, config=cfg, progress=False)
    tok = None
    if (args.checkpoint / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    encode = text_encoder(tok, cfg.text.vocab_size)
    eos = cfg.text.eos_token_id
    eos = eos[0] if isinstance(eos, tuple) else (2 if eos is None else eos)
    stream = heldout_stream(encode, max(2 * args.ctx, 150_000), eos)  # all held-out text: varied haystacks
    res = evaluate(model, encode, stream, ctx=args.ctx, trials=args.trials, seed=args.seed, depths=args.depths,
                   batch=min(args.batch, args.trials))
    res = {"checkpoint": str(args.checkpoint), "attention_impl": cfg.attention_impl, "dense": args.dense,
           "config_override": args.config_override, "dtype": args.dtype, **res,
           "seconds": round(time.time() - t0, 1)}
    print(f"needle: ctx {args.ctx}, {args.trials} trials, block {res['block_size']} top-k {res['topk']}"
          f"{' (all dense)' if args.dense else ''}: accuracy {res['accuracy']:.3f}, "
          f"value log-prob {res['value_logprob']:.3f} ({res['seconds']:.0f}s)")
    for depth, r in res["per_depth"].items():
        print(f"  depth {depth:>9}: {r['accuracy']:.3f} ({r['trials']} trials)")
    if res["needle_block_selected"]:
        print("  needle block selected per MSA layer: "
              + ", ".join(f"{k}: {v:.2f}" for k, v in res["needle_block_selected"].items()))
    if args.output_json:
        atomic_write(args.output_json, json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    cli.run(main, exit_code=lambda _: 0)
