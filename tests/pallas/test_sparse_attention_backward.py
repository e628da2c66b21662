"""Backward of the KV-block-major sparse attention (m3jax/pallas/sparse_attention/backward.py) vs
``jax.vjp`` of the jnp reference, on the same inputs and selections.

On CPU the kernels run in GPU interpret mode (race detector on; unwritten rows are NaN), on a GPU the
compiled kernels run unchanged. Errors are relative in the L2 norm per gradient (||got - ref|| /
||ref||, m3jax/pallas/tolerances.py): fp32 (bf16x3) 2e-5, bf16 2e-2. The cases cover G > 1, -1 slots,
a context that is not a multiple of the block, 128-key blocks shared by two consumer warpgroups and
the same blocks as 64-key sub-blocks of one, the LSE's cotangent, selections both random and made by
the indexer's top-k (own block forced), and the named fallback to the reference gradient where the
kernel cannot run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import msa
from m3jax.msa import kernels
from m3jax.pallas import _backend
from m3jax.pallas.sparse_attention import SparseAttentionConfig, backward, reference, sparse_attention
from m3jax.pallas.tolerances import TOL

F32, BF16 = jnp.float32, jnp.bfloat16


def random_selection(rng, b, kh, t, q_pos, bs, topk):
    """Own block + distinct random earlier blocks, in shuffled slots, with some slots -1."""
    sel = np.full((b, kh, t, topk), -1, np.int32)
    for bb in range(b):
        for hh in range(kh):
            for tt in range(t):
                own = int(q_pos[bb, tt]) // bs
                n_hist = int(rng.integers(0, min(own, topk - 1) + 1))
                ids = [own, *rng.choice(own, size=n_hist, replace=False).tolist()]
                sel[bb, hh, tt, rng.permutation(topk)[: len(ids)]] = ids
    return jnp.asarray(sel)


def make_case(*, g, kh, h, bs, dtype, selection, b=1, t=5, prefix_blocks=2, topk=4, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    prefixes = [(prefix_blocks + i) * bs for i in range(b)]
    s = max(prefixes) + t  # not a multiple of the block
    q = jax.random.normal(ks[0], (b, t, kh * g, h), F32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), F32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), F32).astype(dtype)
    q_pos = jnp.asarray(prefixes, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    if selection == "indexer":  # top-k of random index scores, own block forced
        scores = msa.block_scores(jax.random.normal(ks[3], (b, t, kh, 16)), jax.random.normal(ks[4], (b, s, 16)),
                                  q_pos, bs)
        block_idx = msa.select_blocks(scores, q_pos, block_size=bs, topk=topk)
    else:
        block_idx = random_selection(np.random.default_rng(seed), b, kh, t, np.asarray(q_pos), bs, topk)
    do = jax.random.normal(ks[5], q.shape, F32).astype(dtype)
    return q, k, v, block_idx, q_pos, do


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "non-finite (unwritten) rows in the gradient"
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def check_grads(q, k, v, block_idx, q_pos, do, *, bs, with_lse=False, config=None):
    """Gradients of <o, do> (through m3jax.msa.kernels.attend_selected, or sparse_attention with a
    non-default ``config``) or of <o, do> + <lse, dlse> (through sparse_attention's kv_major path, with
    ``config``) vs the reference's vjp."""
    dlse = jnp.linspace(-1.0, 1.0, q.shape[0] * q.shape[1] * q.shape[2]).reshape(q.shape[:3]) if with_lse else None

    def f(q_, k_, v_):
        if with_lse:
            return sparse_attention(q_, k_, v_, block_idx, q_pos, block_size=bs, return_lse=True, config=config)
        if config not in (None, SparseAttentionConfig()):  # the configured kernel
            return sparse_attention(q_, k_, v_, block_idx, q_pos, block_size=bs, config=config)
        return kernels.attend_selected(q_, k_, v_, block_idx, q_pos, block_size=bs)  # what training calls

    _backend.reset_interpret_state()
    _, vjp = jax.vjp(f, q, k, v)
    got = jax.block_until_ready(vjp((do, dlse) if with_lse else do))
    assert not _backend.interpret_races_found(), "race detector fired"
    ref = reference.sparse_attention_vjp(q, k, v, block_idx, q_pos, do, dlse, block_size=bs)
    tol = TOL[("attention_grad", jnp.dtype(q.dtype).name)]
    for name, a, r, x in zip(("dq", "dk", "dv"), got, ref, (q, k, v)):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        err = rel_err(a, r)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


# (G, KV heads, head dim, block, dtype, selection, batch, LSE cotangent, backward tiles per item, ring,
#  consumer warpgroups)
CASES = [
    (4, 2, 64, 64, F32, "random", 1, False, None, None, None),  # m3-small's G, H and block; -1 slots, shuffled
    (16, 1, 128, 128, BF16, "indexer", 2, True, None, None, None),  # M3's G, H and block: two warpgroups over
    # the 128-key block (the default there); 2 sequences; through the LSE too
    (16, 1, 128, 128, BF16, "random", 1, False, None, None, 1),  # the same block as two 64-key sub-blocks
    # with one warpgroup
    (8, 2, 128, 256, BF16, "indexer", 1, False, 1, None, 2),  # two warpgroups, a 256-key block as two
    # 128-key items, every tile its own item (many item hand-offs between the warpgroups)
    (4, 2, 64, 64, BF16, "indexer", 2, True, 1, 3, None),  # every tile its own item: rows split across CTAs,
    # their dK / dV partials summed in XLA; a 3-deep ring
]


@pytest.mark.parametrize("g,kh,h,bs,dtype,selection,b,with_lse,tpi,stages,wgs", CASES)
def test_kv_major_backward_matches_reference(g, kh, h, bs, dtype, selection, b, with_lse, tpi, stages, wgs):
    # Machine: any: interpret mode on a CPU (two warpgroups: two threads, see tests/conftest.py's
    # PJRT_NPROC), compiled for the device on a GPU (the same assertions on both)
    config = SparseAttentionConfig(backward_tiles_per_item=tpi, backward_stages=stages, backward_warpgroups=wgs)
    # the kernel, not the fallback
    assert backward.unsupported_reason(num_heads=g * kh, num_kv_heads=kh, head_dim=h, block_size=bs,
                                       dtype=jnp.dtype(dtype).name, config=config) is None
    plan = backward.plan_backward(n=g * kh, kh=kh, h=h, block_size=bs, dtype=dtype, cfg=config)
    assert plan.wgs == (wgs or (2 if bs % 128 == 0 and h % 128 == 0 and dtype != F32 else 1))
    q, k, v, bi, qp, do = make_case(g=g, kh=kh, h=h, bs=bs, dtype=dtype, selection=selection, b=b,
                                    t=5 if tpi is None else 40, prefix_blocks=2 if bs < 256 else 1)
    assert (bi < 0).any(), "the case should have empty slots"
    if tpi is not None:  # some row has more than one item
        per_row = [int(((bi[:, hh] == blk).any(-1)[bb]).sum()) for bb in range(b) for hh in range(kh)
                   for blk in range(int(bi.max()) + 1)]
        assert max(per_row) > plan.tq * tpi
    check_grads(q, k, v, bi, qp, do, bs=bs, with_lse=with_lse, config=config)


def test_fallback_to_reference_gradient():
    # Block 16 (below the kernel's 64-key blocks) and H = 32: the named fallback, the reference's vjp.
    # Machine: any: the reference's gradient (the named fallback) on a CPU and on a GPU
    assert "multiple of 64" in backward.unsupported_reason(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    q, k, v, bi, qp, do = make_case(g=2, kh=2, h=32, bs=16, dtype=F32, selection="random", t=3)
    check_grads(q, k, v, bi, qp, do, bs=16)


def test_unsupported_reason_names_the_limit():
    # Machine: any: argument / config checks, no kernel runs
    args = dict(num_heads=64, num_kv_heads=4, head_dim=128, block_size=128)
    assert backward.unsupported_reason(**args) is None
    assert backward.unsupported_reason(**args, dtype="float32") is None
    assert backward.unsupported_reason(num_heads=8, num_kv_heads=2, head_dim=64, block_size=64) is None  # m3-small
    assert "Hopper-only" in backward.unsupported_reason(**args, target=_backend.BLACKWELL)
    assert "head_dim" in backward.unsupported_reason(**{**args, "head_dim": 32})
    assert "G=128" in backward.unsupported_reason(**{**args, "num_heads": 512})
    two = SparseAttentionConfig(backward_warpgroups=2)
    assert "not a multiple of 128" in backward.unsupported_reason(**{**args, "block_size": 64}, config=two)
    assert "fp32" in backward.unsupported_reason(**args, dtype="float32", config=two)
    assert "must be 1 or 2" in backward.unsupported_reason(**args, config=SparseAttentionConfig(backward_warpgroups=3))


@pytest.mark.parametrize("target,g,h,bs,dtype", [("HOPPER", 16, 128, 128, BF16), ("HOPPER", 4, 64, 64, F32),
                                                  ("BLACKWELL", 16, 128, 128, BF16)])
def test_backward_lowers(target, g, h, bs, dtype):
    # The Mosaic GPU lowering (wgmma shapes, transposed SMEM operands, layouts) for CUDA on the CPU:
    # the forward and the backward kernel for Hopper; for Blackwell the forward kernel only (the
    # backward is the reference gradient there; value_and_grad keeps the forward, whose output that
    # gradient does not read). Nothing is compiled.
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    S = jax.ShapeDtypeStruct
    kh, t, ctx, topk = 2, 64, 1024, 4
    args = (S((1, t, kh * g, h), dtype), S((1, ctx, kh, h), dtype), S((1, ctx, kh, h), dtype),
            S((1, kh, t, topk), jnp.int32), S((1, t), jnp.int32))

    def loss(q, k, v, sel, p):
        return sparse_attention(q, k, v, sel, p, block_size=bs).astype(F32).sum()

    with _backend.lowering_for(getattr(_backend, target)):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == (2 if target == "HOPPER" else 1)
