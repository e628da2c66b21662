"""GPU check for the MSA index-score and top-k Mosaic kernels: correctness against the reference (the
``index`` family of :mod:`m3jax.pallas.gpu_checks`: bf16/fp32, block 16-256, top-k 1-64, tolerances
from m3jax/pallas/tolerances.py; ``python -m m3jax.selfcheck --full`` runs it too), then the
benchmark rows (benchmarks/msa_index.py).

Usage (device machine): PYTHONPATH=. python benchmarks/check_index_gpu.py [OUT_DIR] [contexts...]
(OUT_DIR default: ``$OUT``, else benchmarks/out; it writes ``index_gpu.json`` there.)
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from m3jax.pallas import gpu_checks


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "benchmarks/out")
    os.makedirs(out, exist_ok=True)
    ctxs = tuple(int(x) for x in sys.argv[2:]) or (32768, 131072, 1048576)
    rows = []

    def emit(r):
        print(json.dumps(r), flush=True)
        rows.append(r)
        with open(os.path.join(out, "index_gpu.json"), "w") as f:
            json.dump(rows, f, indent=1)

    gpu_checks.run(families=("index",), emit=emit)
    from benchmarks import msa_index

    try:
        msa_index.bench(emit, contexts=ctxs)
    except Exception:  # noqa: BLE001
        emit(dict(error=traceback.format_exc()[-3000:]))


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    main()
