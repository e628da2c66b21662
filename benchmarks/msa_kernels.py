"""MSA kernel benchmark: runs every op's ``bench(report)`` in one process and writes the table.

    PYTHONPATH=. python benchmarks/msa_kernels.py [--only index attention decode] [--out benchmarks/RESULTS.md]

Each row compares a kernel with the best baseline measured in the SAME process (cuDNN attention,
XLA, a bf16 matmul, or our query-major variant); ratios are computed there, never against numbers
from another run. The table is appended to RESULTS.md under a heading with the date, the device,
the JAX version and the command line.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys
import traceback
from pathlib import Path

import jax

OPS = {
    "index": "benchmarks.msa_index",
    "attention": "benchmarks.msa_attention",
    "step": "benchmarks.msa_step",
    "decode": "benchmarks.msa_decode",
}
COLUMNS = ("op", "shape", "impl", "ms", "tflops", "gbps", "baseline", "ratio", "notes")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=list(OPS), default=list(OPS))
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = ap.parse_args(argv)

    rows: list[dict] = []
    failures = []

    def report(row: dict) -> None:
        rows.append(row)
        print(" | ".join(f"{k}={_fmt(row.get(k))}" for k in COLUMNS if row.get(k) is not None), flush=True)

    for op in args.only:
        try:
            importlib.import_module(OPS[op]).bench(report)
        except Exception:  # one op failing must not hide the others' numbers
            failures.append((op, traceback.format_exc()))
            print(f"[{op}] FAILED\n{failures[-1][1]}", file=sys.stderr, flush=True)

    dev = jax.devices()[0]
    head = (
        f"\n## MSA kernels — {datetime.date.today().isoformat()}, {dev.device_kind} ({dev.platform}), "
        f"jax {jax.__version__}\n\nCommand: `python benchmarks/msa_kernels.py {' '.join(argv or sys.argv[1:])}`\n\n"
    )
    table = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    table += "".join("| " + " | ".join(_fmt(r.get(k)) for k in COLUMNS) + " |\n" for r in rows)
    if failures:
        table += "\nFailed: " + ", ".join(op for op, _ in failures) + " (tracebacks in the run log)\n"
    with open(args.out, "a") as f:
        if args.out.stat().st_size == 0:
            f.write("# Benchmark results\n\nEach section is one run; ratios compare against baselines measured in the same process.\n")
        f.write(head + table)
    print(head + table)
    return rows


if __name__ == "__main__":
    main()
