"""Benchmark: a train step of :mod:`m3jax.train` on the MSA kernels against the jnp reference path,
and its peak memory against the context length.

    PYTHONPATH=. python benchmarks/train_step.py                       # GPU: speed at 16K, memory at 16/32/64K
    PYTHONPATH=. python benchmarks/train_step.py --only speed --steps 10
    PYTHONPATH=. python benchmarks/train_step.py --only memory --lengths 16384 32768 65536 --run
    PYTHONPATH=. python benchmarks/train_step.py --ctx 128 --lengths 128 256 512 --attention-chunk 128 --steps 1
        # CPU smoke run, ~3 min (the kernels interpreted)

**Speed** (``--only speed``): one process, the same random m3-small weights (``--config``) and the
same batch, a ``--mode`` step (default ``sparse``) on each path: ``reference`` (every attention
through the chunked jnp reference, plain autodiff) and ``pallas`` (sparse attention through
:func:`m3jax.msa.kernels.attend_selected` and its custom VJP, dense attention through cuDNN; off
the GPU the kernels run in interpret mode, which says nothing about speed). Both paths run query
chunks of ``--attention-chunk`` rows. Wall-clock median over ``--steps`` steps after one compiling
step; the row gives ms per step on each path and the ratio reference / kernels.

**Memory** (``--only memory``): per context length of ``--lengths`` (ascending), the peak of one
step on the kernel path (``--impl`` to choose another): the compiled step's memory analysis
(arguments + outputs + temporaries - donated aliases: what XLA plans to hold at once), and with
``--run`` on a GPU the device's ``peak_bytes_in_use`` after running it (a process-wide high-water
mark: with ascending lengths each row's value is that length's peak). ``growth`` is the ratio to the
previous length's peak, per doubling of the context when the lengths double.

Rows are printed as JSON and appended to $OUT/train_step.jsonl (default benchmarks/out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from m3jax import train as tr
from m3jax.config import preset
from m3jax.msa import layer as msa_layer

from run_info import run_info


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="m3_small")
    ap.add_argument("--only", choices=["speed", "memory"], default=None, help="run one part (default both)")
    ap.add_argument("--ctx", type=int, default=16384, help="speed: tokens per row")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536], help="memory: context lengths")
    ap.add_argument("--steps", type=int, default=5, help="speed: timed steps per path (after one compiling step)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--mode", choices=tr.MODES, default="sparse")
    ap.add_argument("--dtype", choices=tr.DTYPES, default="bfloat16")
    ap.add_argument("--attention-chunk", type=int, default=tr.KERNEL_QUERY_CHUNK, help="query rows per chunk (both paths)")
    ap.add_argument("--impl", choices=["pallas", "reference"], default="pallas", help="memory: the path measured")
    ap.add_argument("--run", action="store_true", help="memory: also run each step and read the device's peak")
    return ap.parse_args(argv)


def _cfg(args, impl: str, ctx: int):
    cfg = preset(args.config)
    with warnings.catch_warnings():  # "pallas" off the GPU: interpret mode, said in the docstring
        warnings.simplefilter("ignore")
        impl = msa_layer.resolve_attention_impl(impl, cfg, args.dtype)
    return cfg.replace(attention_impl=impl, attention_chunk=min(args.attention_chunk, ctx))


def _step_and_inputs(args, impl: str, ctx: int, params):
    """(jitted step, state, batch) of ``args.mode`` on the path ``impl`` at ``ctx`` tokens."""
    cfg = _cfg(args, impl, ctx)
    tx = tr.make_optimizer(args.mode, 100)
    step = tr.make_train_step(cfg, tx, args.mode, dtype=args.dtype)
    state = tr.init_state(jax.tree.map(jnp.copy, params), tx)  # the step donates its state
    rng = np.random.default_rng(ctx)
    batch = {"tokens": rng.integers(3, cfg.text.vocab_size, (args.batch, ctx + 1)).astype(np.int32)}
    return step, state, batch


def speed(args, params) -> dict:
    ms = {}
    for impl in ("reference", "pallas"):
        step, state, batch = _step_and_inputs(args, impl, args.ctx, params)
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, m = step(state, batch)
            jax.block_until_ready(m)
            times.append((time.perf_counter() - t0) * 1e3)
        ms[impl] = statistics.median(times)
        print(f"{impl}: {ms[impl]:.1f} ms/step (first step {compile_s:.1f} s), loss {float(m['loss']):.4f}", flush=True)
        del state
    return {"part": "speed", "config": args.config, "mode": args.mode, "dtype": args.dtype, "ctx": args.ctx,
            "batch": args.batch, "attention_chunk": min(args.attention_chunk, args.ctx), "steps": args.steps,
            "reference_ms": round(ms["reference"], 2), "kernels_ms": round(ms["pallas"], 2),
            "speedup": round(ms["reference"] / ms["pallas"], 2)}


def _planned_peak(compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def memory(args, params) -> list[dict]:
    rows, prev = [], None
    for ctx in sorted(args.lengths):
        step, state, batch = _step_and_inputs(args, args.impl, ctx, params)
        planned = _planned_peak(step.lower(state, batch).compile())
        row = {"part": "memory", "config": args.config, "mode": args.mode, "dtype": args.dtype, "impl": args.impl,
               "ctx": ctx, "batch": args.batch, "attention_chunk": min(args.attention_chunk, ctx),
               "planned_peak_gib": None if planned is None else round(planned / 2**30, 3)}
        peak = planned
        if args.run:
            state, m = step(state, batch)
            jax.block_until_ready(m)
            stats = jax.devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                peak = int(stats["peak_bytes_in_use"])
                row["device_peak_gib"] = round(peak / 2**30, 3)
        if prev is not None and peak and prev[1]:
            row["growth"] = round(peak / prev[1], 2)
            row["length_ratio"] = round(ctx / prev[0], 2)
        prev = (ctx, peak)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del state
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    info = run_info("train_step.py", argv)
    params = tr.init_train_params(preset(args.config), seed=0)
    rows = []
    if args.only in (None, "speed"):
        rows.append(speed(args, params))
        print(json.dumps(rows[-1]), flush=True)
    if args.only in (None, "memory"):
        rows += memory(args, params)
    out = os.environ.get("OUT", "benchmarks/out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train_step.jsonl"), "a") as fh:
        for r in rows:
            fh.write(json.dumps({**r, **info}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
