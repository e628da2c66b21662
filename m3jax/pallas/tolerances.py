"""The one table of kernel-vs-reference tolerances: the kernel tests, the GPU checks and the self-check's
canaries (:mod:`m3jax.pallas.canaries`).

``TOL[(quantity, dtype)]`` is passed to ``np.testing.assert_allclose(got, ref, **TOL[...])``:
``|got - ref| <= atol + rtol * |ref|`` element-wise, the reference computed in fp32 at HIGHEST
precision on the same (possibly bf16) inputs. Why these values:

- fp32 inputs run "bf16x3" on the tensor cores (hi.hi + hi.lo + lo.hi, each product ~2^-16 relative,
  docs/KERNELS.md §1.5), so fp32 attention lands within ~1e-5 of the fp32 reference.
- bf16 inputs: P is rounded to bf16 for the PV MMA and the output is bf16 (2^-8 relative each), so
  bf16 attention is held to 2e-2; its LSE (fp32 accumulation of exact bf16 products) to 1e-3.
- index block scores (prefill and decode kernels): bf16 inputs are exact products with fp32
  accumulation in another order, 2e-4; fp32 inputs are split into three bf16 pieces (six products,
  ~24 mantissa bits, pallas/_common.bf16_split) because the scores decide selections: 2e-5, the
  fp32 accumulation-order noise of two summations (unit normals at Hx = 128, against float64: fp32
  max |err| 1.0e-5, three pieces 5e-7, two pieces "bf16x3" 3.0e-4).
- index block scores of the fp8 indexer (``score_dtype="float8_e4m3fn"``; kernel and reference on the
  same e4m3 operands and scales, :func:`m3jax.msa.reference.fp8_index_operands`): a bound relative
  to the block's score scale S (the largest sum_i |qv_i kv_i| qs ks over its keys), not to |ref|:
  ``|got - ref| <= Hx * TOL * S``. The e4m3 products are exact, but Hopper's fp8 MMA sums them with
  fewer bits than fp32 (the DeepSeek-V3 technical report, §3.3.2: "around 14 bits"), so each of the
  Hx additions may lose up to 2^-13 of a partial sum bounded by S. Interpret mode sums in fp32
  (~Hx 2^-24 S); the GPU's error under this bound is unmeasured.
- decode attention: as attention (fp32 bf16x3, 2e-5: the decode kernel's split-K LSE merge adds a
  rounding; bf16 3e-2: P and the output in bf16, partial outputs merged in fp32).
- attention gradients (dQ, dK, dV of the sparse-attention backward; relative L2 error per gradient):
  fp32 2e-5: bf16x3 in every MMA as the forward, but dQ and dK chain two of them (S and dP = dO V^T
  into dS, then dS K or dS^T Q), each ~2^-16 relative, so they land at 1.0e-5 where the forward's
  output is at 3.5e-6 (m3-small's G, H and block; dV, one chained product fewer, 3.8e-6); a 1e-5
  bound needs the six products of three-piece splits in S and dP. bf16 2e-2 (P and dS rounded to
  bf16 for their MMAs).
- block mass (the indexer objective's target, :mod:`m3jax.pallas.block_mass`): fp32 inputs split into
  three bf16 pieces (six products, fp32 accuracy) as the index scores, 1e-5 (the issue's bound);
  bf16 inputs are exact products with fp32 accumulation, held to the attention bound 2e-2.
- model logits (relative L2 error): fp32 1e-5 against the oracle (its bound, tests.conftest.TOL).
  bf16 has no fixed bound: random weights make bf16 noise large (1e-2 to 7e-2 from the fp32 oracle
  for the reference path on the kernel fixtures). The kernels path in bf16 is held to at most 2x the
  bf16 reference path's error against the fp32 oracle: its attention rounds P to bf16 for the PV
  MMA on top of the output rounding both paths do, two bf16 roundings per output where the reference
  has one (measured 1.7x on kernel_g2, below 1.25x on kernel_g8).
"""

from __future__ import annotations

TOL = {
    ("attention", "float32"): dict(atol=1e-5, rtol=1e-5),
    ("attention", "bfloat16"): dict(atol=2e-2, rtol=2e-2),
    ("lse", "float32"): dict(atol=1e-5, rtol=1e-5),
    ("lse", "bfloat16"): dict(atol=1e-3, rtol=1e-3),
    ("index_scores", "float32"): dict(atol=2e-5, rtol=2e-5),
    ("index_scores", "bfloat16"): dict(atol=2e-4, rtol=2e-4),
    ("index_scores", "float8_e4m3fn"): 2.0**-13,  # per product of Hx, times the score scale S (above)
    ("decode_attention", "float32"): dict(atol=2e-5, rtol=2e-5),
    ("decode_attention", "bfloat16"): dict(atol=3e-2, rtol=3e-2),
    ("block_mass", "float32"): dict(atol=1e-5, rtol=1e-5),
    ("block_mass", "bfloat16"): dict(atol=2e-2, rtol=2e-2),
    ("attention_grad", "float32"): 2e-5,
    ("attention_grad", "bfloat16"): 2e-2,
    ("model_logits", "float32"): 1e-5,
    ("model_logits_vs_reference_error", "bfloat16"): 2.0,
}
