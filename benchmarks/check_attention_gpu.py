"""GPU correctness check of the MSA sparse-attention kernels against the jnp reference (docs/MSA.md §4.3):
the ``attention`` family of :mod:`m3jax.pallas.gpu_checks` (the cases and the comparison live there, and
``python -m m3jax.selfcheck --full`` runs them too).

Run on the device machine: ``PYTHONPATH=. python benchmarks/check_attention_gpu.py``. Prints one JSON line
per case and kernel (max abs error, error over tolerance of out and LSE, pass/fail at
m3jax/pallas/tolerances.py, bitwise determinism of reruns), appended to ``$OUT/check_attention_gpu.jsonl``
where ``$OUT`` is set, then ALL_OK or SOME_FAILED.
"""

from __future__ import annotations

import json
import os

from m3jax.pallas import gpu_checks


def main():
    out_dir = os.environ.get("OUT")

    def emit(row):
        print(json.dumps(row), flush=True)
        if out_dir:
            with open(os.path.join(out_dir, "check_attention_gpu.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")

    rows = gpu_checks.run(families=("attention",), emit=emit)
    print("ALL_OK" if all(r["passed"] for r in rows) else "SOME_FAILED")


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    main()
