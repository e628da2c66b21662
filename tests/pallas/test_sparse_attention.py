"""MSA block-sparse prefill attention kernels vs the jnp reference, and their plans.

On CPU the kernels run in GPU interpret mode (every TMA, barrier and warpgroup op simulated, race
detector on), so shapes are tiny; on the H200 the same tests run the compiled kernels unchanged. One
parametrized body per kernel covers G (query heads per KV head) in {1, 2, 4, 8, 16}, blocks 16 / 32 /
64 (and 128 in fp32, which the KV-major kernel splits into 64-key sub-blocks), head dims 32 / 64 / 128,
fp32 (bf16x3) and bf16, at the tolerances of m3jax/pallas/tolerances.py. Unwritten output or staging
rows show as NaN: interpret mode fills every output and SMEM buffer with NaN before the kernel runs
(checked below), and the combine reads staging rows only at the edges the plan says were written.
The KV-major body also runs cases as built for Blackwell (tcgen05 into TMEM, m3jax/pallas/
sparse_attention/blackwell.py) in interpret mode, which models tcgen05 and TMEM but not their shape
and layout rules (test_lowering.py lowers the variant for sm_100a).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import msa
from m3jax.pallas import _backend
from m3jax.pallas.sparse_attention import SparseAttentionConfig, csr, kernel, sparse_attention
from m3jax.pallas.tolerances import TOL

F32, BF16 = jnp.float32, jnp.bfloat16


def make_inputs(*, g, kh, h, bs, dtype, b=1, t=6, prefix_blocks=2, topk=3, seed=0, shuffle=False):
    """Random q/k/v, positions prefix + arange(t) per batch (batch i: i * block later), MSA selections."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    prefixes = [(prefix_blocks + i) * bs for i in range(b)]
    s = max(prefixes) + t
    q = jax.random.normal(ks[0], (b, t, kh * g, h), F32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), F32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), F32).astype(dtype)
    q_pos = jnp.asarray(prefixes, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    scores = msa.block_scores(jax.random.normal(ks[3], (b, t, kh, 16)), jax.random.normal(ks[4], (b, s, 16)), q_pos, bs)
    block_idx = msa.select_blocks(scores, q_pos, block_size=bs, topk=topk)
    if shuffle:  # valid entries in any order, -1 slots anywhere
        block_idx = block_idx[..., ::-1]
    return q, k, v, block_idx, q_pos


def check(impl, bs, q, k, v, block_idx, q_pos, cfg=None):
    _backend.reset_interpret_state()
    out, lse = sparse_attention(q, k, v, block_idx, q_pos, block_size=bs, implementation=impl, config=cfg,
                                return_lse=True)
    out = jax.block_until_ready(out)
    assert not _backend.interpret_races_found(), "race detector fired"
    ref, ref_lse = sparse_attention(q, k, v, block_idx, q_pos, block_size=bs, implementation="reference",
                                    return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    name = jnp.dtype(q.dtype).name
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "unwritten (NaN) rows reached the output"
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), **TOL[("attention", name)])
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **TOL[("lse", name)])


def test_interpret_mode_poisons_outputs():
    # The NaN check in `check` relies on it: unwritten output / staging rows are NaN in interpret mode.
    # Machine: any: interpret mode's parameters (what the tests' NaN check relies on)
    assert _backend.interpret_params().uninitialized_memory == "nan"


# (G, KV heads, head dim, block, dtype, batch, shuffled slots): a small cross-product; shapes repeat
# across dtypes where they can, so the interpreted kernels are traced once per shape.
KV_MAJOR_CASES = [
    (1, 2, 32, 16, F32, 1, False),  # m3-tiny's head dim
    (2, 2, 128, 32, BF16, 1, True),
    (4, 2, 64, 64, F32, 1, False),  # m3-small's G and block
    (8, 1, 128, 16, BF16, 1, True),
    (16, 1, 64, 64, BF16, 2, False),  # M3's G; two sequences
    (16, 1, 128, 128, F32, 1, False),  # fp32 at H=128: 64-key sub-blocks of the 128-key block
]


# Blackwell: 128-row tiles (8 tokens at G 16, 16 tokens at G 8...), S read from TMEM in 64-column
# pieces (block 128 at H 64: two), fp32 as bf16 pieces, two sequences.
KV_MAJOR_BLACKWELL_CASES = [
    (4, 2, 64, 64, F32, 1, False),
    (16, 1, 64, 64, BF16, 2, False),
    (8, 1, 64, 128, BF16, 1, False),
]


@contextlib.contextmanager
def _as_blackwell(monkeypatch):
    """Build the kernels for sm_100a in interpret mode, and check that the tcgen05 tile maths ran."""
    from m3jax.pallas.sparse_attention import blackwell

    calls = []
    tile = blackwell.tile
    monkeypatch.setattr(blackwell, "tile", lambda *a: calls.append(1) or tile(*a))
    with _backend.interpret_as(_backend.BLACKWELL):
        yield
    assert calls, "the Blackwell tile maths did not run"


@pytest.mark.parametrize("target,g,kh,h,bs,dtype,b,shuffle", [("device", *c) for c in KV_MAJOR_CASES]
                         + [("blackwell", *c) for c in KV_MAJOR_BLACKWELL_CASES])
def test_kv_major_matches_reference(target, g, kh, h, bs, dtype, b, shuffle, monkeypatch):
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    q, k, v, bi, qp = make_inputs(g=g, kh=kh, h=h, bs=bs, dtype=dtype, b=b, shuffle=shuffle)
    with _as_blackwell(monkeypatch) if target == "blackwell" else contextlib.nullcontext():
        check("kv_major", bs, q, k, v, bi, qp)


QUERY_MAJOR_CASES = [
    (1, 2, 128, 32, F32, 1, False),
    (2, 2, 32, 16, BF16, 1, True),
    (8, 1, 128, 64, F32, 1, True),
    (16, 1, 64, 32, BF16, 1, False),
]


@pytest.mark.parametrize("g,kh,h,bs,dtype,b,shuffle", QUERY_MAJOR_CASES)
def test_query_major_matches_reference(g, kh, h, bs, dtype, b, shuffle):
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    q, k, v, bi, qp = make_inputs(g=g, kh=kh, h=h, bs=bs, dtype=dtype, b=b, t=3, shuffle=shuffle)
    check("query_major", bs, q, k, v, bi, qp)


def test_kv_major_deeper_q_ring_short_items():
    # Rows of several tiles (12 queries of one block, tq = 4), items of 2 tiles and a 3-deep ring (the
    # other tests run the default 2): the prologue, wrap-around and items shorter than the ring run.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    q, k, v, bi, qp = make_inputs(g=16, kh=1, h=64, bs=64, dtype=BF16, t=12, prefix_blocks=1, topk=2, seed=5)
    check("kv_major", 64, q, k, v, bi, qp, cfg=SparseAttentionConfig(q_stages=3, tiles_per_item=2))


# ---------------------------------------------------------------------------------------------
# Plans (plain Python / jnp: no kernel runs)
# ---------------------------------------------------------------------------------------------

CFG = SparseAttentionConfig(p_via_smem=False)  # P in registers, as on the GPU


def test_plan_m3_shapes():
    # M3: N=64, K=4, H=128, block 128. bf16 keeps the tuned tiles: 4 tokens x 16 heads, the whole
    # block, 2 CTAs per SM. fp32: hi + lo tiles, 64-key sub-blocks, fp32 partials, 1 CTA per SM.
    # Machine: any: host-side planning, no kernel runs
    bf = kernel.plan_kv_major(n=64, kh=4, h=128, block_size=128, dtype=BF16, cfg=CFG, target=_backend.HOPPER)
    assert (bf.gp, bf.m, bf.tq, bf.kb, bf.n_parts, bf.stage_dtype) == (16, 64, 4, 128, 1, "bfloat16")
    assert kernel.ctas_fitting(bf.smem, _backend.HOPPER) == 2
    fp = kernel.plan_kv_major(n=64, kh=4, h=128, block_size=128, dtype=F32, cfg=CFG, target=_backend.HOPPER)
    assert (fp.kb, fp.n_parts, fp.stage_dtype) == (64, 2, "float32")
    assert fp.smem <= _backend.HOPPER.smem_bytes and kernel.ctas_fitting(fp.smem, _backend.HOPPER) == 1
    qm = kernel.plan_query_major(n=64, kh=4, h=128, block_size=128, dtype=BF16, cfg=CFG, target=_backend.HOPPER)
    assert (qm.kb, qm.stages) == (128, 2)


def test_plan_m3_shapes_blackwell():
    # tcgen05: 128-row tiles (8 tokens x 16 heads), P through SMEM, the whole block at bf16; fp32 at
    # H=128 only fits 16-key sub-blocks next to two 128-row Q stages; fp32 at H=256 is refused.
    # Machine: any: host-side planning, no kernel runs (for sm_100a)
    bw = _backend.BLACKWELL
    bf = kernel.plan_kv_major(n=64, kh=4, h=128, block_size=128, dtype=BF16, cfg=CFG, target=bw)
    assert (bf.m, bf.tq, bf.kb, bf.stage_p, bf.mma) == (128, 8, 128, True, "tcgen05") and bf.smem <= bw.smem_bytes
    assert kernel.plan_kv_major(n=64, kh=4, h=128, block_size=256, dtype=BF16, cfg=CFG, target=bw).kb == 128
    assert kernel.plan_kv_major(n=64, kh=4, h=128, block_size=128, dtype=F32, cfg=CFG, target=bw).kb == 16
    assert "no KV-major tiles fit" in kernel.unsupported_reason(num_heads=64, num_kv_heads=4, head_dim=256,
                                                                 block_size=128, dtype="float32", target=bw)


@pytest.mark.parametrize("g,gp,tq", [(1, 8, 8), (2, 8, 8), (4, 8, 8), (8, 8, 8), (12, 16, 4), (16, 16, 4),
                                     (64, 64, 1), (128, 128, 1)])
def test_plan_packs_groups(g, gp, tq):
    # Machine: any: host-side planning, no kernel runs
    plan = kernel.plan_kv_major(n=2 * g, kh=2, h=64, block_size=64, dtype=BF16, cfg=CFG, target=_backend.HOPPER)
    assert (plan.gp, plan.tq, plan.m) == (gp, tq, max(64, gp))


@pytest.mark.parametrize("bs,kb", [(16, 16), (32, 32), (48, 16), (64, 64), (192, 192), (256, 256), (512, 256)])
def test_plan_key_block_divides_block(bs, kb):
    # Machine: any: host-side planning, no kernel runs
    plan = kernel.plan_kv_major(n=16, kh=1, h=64, block_size=bs, dtype=BF16, cfg=CFG, target=_backend.HOPPER)
    assert plan.kb == kb and kernel.pv_swizzle_minor(kb, 64) == min(kb, 64)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_heads=12, num_kv_heads=8), "multiple of the KV heads"),
    (dict(num_heads=512, num_kv_heads=2), "G=256"),
    (dict(head_dim=48), "head_dim"),
    (dict(block_size=8), "block_size"),
    (dict(dtype="float64"), "dtype"),
])
def test_unsupported_reason(kwargs, match):
    # Machine: any: argument / config checks, no kernel runs
    args = dict(num_heads=64, num_kv_heads=4, head_dim=128, block_size=128)
    assert kernel.unsupported_reason(**args) is None
    assert kernel.unsupported_reason(**args, dtype="float32") is None
    assert kernel.unsupported_reason(num_heads=8, num_kv_heads=2, head_dim=64, block_size=64) is None  # m3-small
    reason = kernel.unsupported_reason(**{**args, **kwargs})
    assert reason and match in reason
    q = jnp.ones((1, 4, args["num_heads"], args["head_dim"]), BF16)
    with pytest.raises(ValueError, match="head_dim"):
        sparse_attention(q[..., :48], q[:, :, :4, :48], q[:, :, :4, :48], jnp.zeros((1, 4, 4, 2), jnp.int32),
                         jnp.zeros((1, 4), jnp.int32), block_size=64)
    with pytest.raises(ValueError, match="implementation"):
        sparse_attention(q, q[:, :, :4], q[:, :, :4], jnp.zeros((1, 4, 4, 2), jnp.int32), jnp.zeros((1, 4), jnp.int32),
                         block_size=64, implementation="nope")


def test_unsupported_reason_judges_the_kv_major_kernel(monkeypatch):
    # Machine: any: host-side planning, no kernel runs
    # the model runs the KV-major kernel only: the query-major baseline is judged when asked by name
    def refuse(**_):
        raise ValueError("query-major refuses")

    monkeypatch.setattr(kernel, "plan_query_major", refuse)
    args = dict(num_heads=64, num_kv_heads=4, head_dim=128, block_size=128)
    assert kernel.unsupported_reason(**args) is None
    assert kernel.unsupported_reason(**args, implementation="query_major") == "query-major refuses"


def test_split_blocks_into_sub_blocks():
    # block 128 -> 64-key sub-blocks: both halves of an earlier block; the own block's second half only
    # once the query reaches it; -1 stays -1.
    # Machine: any: host-side planning, no kernel runs
    bi = jnp.asarray([[[[0, 2, -1], [0, 2, -1]]]], jnp.int32)  # [B=1, K=1, T=2, topk=3]
    qp = jnp.asarray([[300, 400]], jnp.int32)  # own block 2 (256..383): 300 < 320, 400 is block 3
    got = np.asarray(kernel.split_blocks(bi, qp, 128, 64))
    np.testing.assert_array_equal(got[0, 0, 0], [0, 1, 4, -1, -1, -1])
    np.testing.assert_array_equal(got[0, 0, 1], [0, 1, 4, 5, -1, -1])


def test_csr_plan_covers_every_edge_once():
    # Machine: any: host-side planning, no kernel runs
    """The CSR/work list (pure jnp) puts each valid (query, slot) on exactly one padded edge of its row."""
    b, t, topk, tq, tpi, kh, bs = 2, 40, 3, 4, 2, 2, 64
    _, _, _, block_idx, q_pos = make_inputs(g=8, kh=kh, h=64, bs=bs, dtype=F32, b=b, t=t, topk=topk, shuffle=True)
    nb = -(-int(q_pos.max() + 1) // bs)
    build = jax.jit(csr.build_work, static_argnames=("num_blocks", "block_size", "tq", "tiles_per_item"))
    plan = build(block_idx, q_pos, num_blocks=nb, block_size=bs, tq=tq, tiles_per_item=tpi)
    e_pad, n_cap = csr.capacities(b, t, kh, nb, topk, tq, tpi)
    bi, ep = np.asarray(block_idx), np.asarray(plan.epos)
    assert ((ep >= 0) == (bi >= 0)).all()
    items = np.asarray(plan.items)[: int(plan.n_items[0])]
    assert len(items) <= n_cap
    owner = {}  # tile -> (batch, block) from the work list
    for hh, bb, blk, t0, nt in items:
        assert 1 <= nt <= tpi
        for tile in range(t0, t0 + nt):
            assert (hh, tile) not in owner
            owner[(hh, tile)] = (bb, blk)
    qtok, qlim = np.asarray(plan.qtok), np.asarray(plan.qlim)
    seen = set()
    for bb, hh, tt, ss in zip(*np.nonzero(bi >= 0)):
        e = ep[bb, hh, tt, ss]
        assert e < e_pad and (hh, e) not in seen
        seen.add((hh, e))
        assert owner[(hh, e // tq)] == (bb, bi[bb, hh, tt, ss])
        assert qtok[hh, e] == tt
        assert qlim[hh, e] == q_pos[bb, tt] - bi[bb, hh, tt, ss] * bs


@pytest.mark.parametrize("impl,g,h,bs,dtype", [("kv_major", 16, 128, 128, BF16), ("kv_major", 4, 32, 16, F32),
                                                ("query_major", 1, 64, 32, BF16), ("query_major", 16, 128, 128, F32)])
def test_lowers_for_hopper(impl, g, h, bs, dtype):
    # The real Mosaic GPU lowering checks what interpret mode does not (wgmma K steps against the
    # swizzle, register-A P, N granularity), here for CUDA on the CPU; nothing is compiled.
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    S = jax.ShapeDtypeStruct
    kh, t, ctx, topk = 2, 64, 1024, 4
    args = (S((1, t, kh * g, h), dtype), S((1, ctx, kh, h), dtype), S((1, ctx, kh, h), dtype),
            S((1, kh, t, topk), jnp.int32), S((1, t), jnp.int32))
    f = lambda *a: sparse_attention(*a, block_size=bs, implementation=impl)
    with _backend.lowering_for(_backend.HOPPER):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
