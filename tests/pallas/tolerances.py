"""The one table of kernel-vs-reference tolerances for tests/pallas (and the GPU checks).

``TOL[(quantity, dtype)]`` is passed to ``np.testing.assert_allclose(got, ref, **TOL[...])``:
``|got - ref| <= atol + rtol * |ref|`` element-wise, the reference computed in fp32 at HIGHEST
precision on the same (possibly bf16) inputs. Why these values:

- fp32 inputs run "bf16x3" on the tensor cores (hi.hi + hi.lo + lo.hi, each product ~2^-16 relative,
  docs/KERNELS.md §1.5), so fp32 attention lands within ~1e-5 of the fp32 reference.
- bf16 inputs: P is rounded to bf16 for the PV MMA and the output is bf16 (2^-8 relative each), so
  bf16 attention is held to 2e-2; its LSE (fp32 accumulation of exact bf16 products) to 1e-3.
- index block scores: fp32 accumulation over the index head dim, 2e-4 for bf16 and fp32 (bf16x3).
"""

from __future__ import annotations

TOL = {
    ("attention", "float32"): dict(atol=1e-5, rtol=1e-5),
    ("attention", "bfloat16"): dict(atol=2e-2, rtol=2e-2),
    ("lse", "float32"): dict(atol=1e-5, rtol=1e-5),
    ("lse", "bfloat16"): dict(atol=1e-3, rtol=1e-3),
    ("index_scores", "float32"): dict(atol=2e-4, rtol=2e-4),
    ("index_scores", "bfloat16"): dict(atol=2e-4, rtol=2e-4),
}
