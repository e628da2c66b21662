"""GPU check of the MSA decode kernels against their references (Mosaic GPU lowering + numerics): the
``decode`` family of :mod:`m3jax.pallas.gpu_checks` (``python -m m3jax.selfcheck --full`` runs it too).

Each kernel is checked on its own (an error in one is reported and does not hide the other):
``decode_index_scores`` vs the reference scores, and ``sparse_decode_attention`` fed with the
selection of the REFERENCE scores, vs the reference attention; ``decode_select_fused`` (the fused
selection) vs the top-k of the scoring kernel's own scores, exactly (rows whose sets differ from
the reference selection in the notes). Shapes are M3's (N=64, K=4, H=128,
Hi=4, Hx=128, page 128, top-k 16), Q=1 and Q=4, batch 2 with different ~128K lengths (not multiples
of the page), one unused page-table column, shuffled page table, bf16 and fp32; then fp8 e4m3
index-key pages with bf16 and fp32 queries; then other block sizes / top-k. Tolerances:
m3jax/pallas/tolerances.py; ``err/tol`` = max |got - ref| / (atol + rtol |ref|) (<= 1 passes),
``maxabs`` the raw max abs difference.

Run on the device: ``PYTHONPATH=. python benchmarks/check_decode_gpu.py``.
"""

from __future__ import annotations

import jax

from m3jax.pallas import gpu_checks

_NOTES = ("inf_pattern_ok", "finite", "selected_blocks", "rows_differing_from_reference", "error")


def _print_row(r):
    err, maxabs = (f"{r[k]:.3g}" if k in r else "" for k in ("err_over_tol", "max_abs"))
    notes = ", ".join(f"{k} {r[k]}" for k in _NOTES if k in r)
    print(f"| {r['kernel']} | {r['case']} | {'PASS' if r['passed'] else 'FAIL'} | {err} | {maxabs} | {notes} | "
          f"{r['seconds']:.1f} |", flush=True)


def main():
    print(jax.devices(), jax.__version__, flush=True)
    print("| kernel | case | result | err/tol | maxabs | notes | s |\n|---|---|---|---|---|---|---|", flush=True)
    rows = gpu_checks.run(families=("decode",), emit=_print_row)
    print(f"\n{sum(r['passed'] for r in rows)}/{len(rows)} checks passed", flush=True)


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    main()
