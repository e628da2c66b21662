"""Every Mosaic GPU kernel lowers for CUDA on a CPU machine for Blackwell (sm_100a), at M3's shapes
(Hi = K = 4 index / KV heads, G = 16, H = Hx = 128, block 128, top-16).

``_backend.lowering_for`` makes Mosaic GPU lower for the target's arch (jax 0.11.2 has no option for
it) and the kernels trace as on that GPU. Lowering builds and verifies the Mosaic module and emits
its custom call; PTX and ptxas run only when XLA compiles on a GPU, so nothing here is compiled.

What this shows for sm_100a: the kernels lower. The query-major attention baseline, a Hopper-only
kernel, lowers too: its module carries ``wgmma`` (and Mosaic's wgmma fences), and it is when that
module is compiled to PTX for sm_100a that Mosaic refuses it (``nvvm.wgmma.fence.aligned`` is not
supported there: tests/pallas/test_compile.py), so on a B200 its canary fails and the model never
picks it; top-k has no MMA and carries none. The
grouped GEMM, the prefill index scoring (with its fused top-k), the KV-block-major sparse attention,
the decode index scoring and the sparse decode attention have Blackwell paths (``BLACKWELL_VARIANTS``): for sm_100a their modules carry
``tcgen05.mma`` and no wgmma (the lowering checks tcgen05's shape, layout and TMEM rules, which
interpret mode does not).
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import re

import jax
import jax.numpy as jnp
import pytest

from m3jax.pallas import _backend

S = jax.ShapeDtypeStruct
BF16, F32, I32, FP8 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.float8_e4m3fn
T, CTX, BS, TOPK, HI, G, H = 256, 8192, 128, 16, 4, 16, 128
NB = CTX // BS


def _index_scores():
    from m3jax.pallas.index_scores import index_block_scores

    return (lambda iq, ik, p: index_block_scores(iq, ik, p, block_size=BS),
            (S((1, T, HI, H), BF16), S((1, CTX, H), BF16), S((1, T), I32)))


def _index_scores_fp8():
    from m3jax.pallas.index_scores import index_block_scores

    return (lambda iq, ik, p: index_block_scores(iq, ik, p, block_size=BS, score_dtype="float8_e4m3fn"),
            (S((1, T, HI, H), BF16), S((1, CTX, H), BF16), S((1, T), I32)))


def _index_topk_fused():
    from m3jax.pallas.index_scores import IndexScoreConfig, index_select_blocks

    cfg = IndexScoreConfig(fused_topk=True)
    return (lambda iq, ik, p: index_select_blocks(iq, ik, p, block_size=BS, topk=TOPK, config=cfg),
            (S((1, T, HI, H), BF16), S((1, CTX, H), BF16), S((1, T), I32)))


def _topk(impl, rows_t):
    from m3jax.pallas.topk import select_blocks

    return (lambda s, p: select_blocks(s, p, block_size=BS, topk=TOPK, implementation=impl),
            (S((1, HI, rows_t, NB), F32), S((1, rows_t), I32)))


def _sparse_attention(impl):
    from m3jax.pallas.sparse_attention import sparse_attention

    return (lambda q, k, v, sel, p: sparse_attention(q, k, v, sel, p, block_size=BS, implementation=impl),
            (S((1, T, HI * G, H), BF16), S((1, CTX, HI, H), BF16), S((1, CTX, HI, H), BF16),
             S((1, HI, T, TOPK), I32), S((1, T), I32)))


def _decode_index_scores():
    from m3jax.pallas.decode import decode_index_scores

    return (lambda iq, ik, pt, sl: decode_index_scores(iq, ik, pt, sl, block_size=BS),
            (S((2, 1, HI, H), BF16), S((2 * NB, BS, H), BF16), S((2, NB), I32), S((2,), I32)))


def _decode_index_scores_fp8():
    """The fp8 indexer's decode scoring: e4m3 queries against the e4m3 pages as stored (the page as
    loaded the wgmma's A); None where the target has no such path (tcgen05: its canary is "n/a")."""
    from m3jax.pallas.decode import decode_index_scores, fp8_scores_unsupported_reason

    if fp8_scores_unsupported_reason(FP8):
        return None
    return (lambda iq, ik, pt, sl: decode_index_scores(iq, ik, pt, sl, block_size=BS, score_dtype="float8_e4m3fn"),
            (S((2, 1, HI, H), BF16), S((2 * NB, BS, H), FP8), S((2, NB), I32), S((2,), I32)))


def _decode_registers(select: bool):  # bf16 queries, fp8 pages converted in registers (opt-in)
    from m3jax.pallas.decode import DecodeScoreConfig, decode_index_scores, decode_select_blocks

    cfg = DecodeScoreConfig(fp8_convert="registers")
    if select:
        f = lambda iq, ik, pt, sl: decode_select_blocks(iq, ik, pt, sl, block_size=BS, topk=TOPK, config=cfg)
    else:
        f = lambda iq, ik, pt, sl: decode_index_scores(iq, ik, pt, sl, block_size=BS, config=cfg)
    return f, (S((2, 1, HI, H), BF16), S((2 * NB, BS, H), FP8), S((2, NB), I32), S((2,), I32))


def _sparse_decode_attention():
    from m3jax.pallas.decode import sparse_decode_attention

    return (lambda q, k, v, pt, sel, sl: sparse_decode_attention(q, k, v, pt, sel, sl, block_size=BS),
            (S((2, 1, HI * G, H), BF16), S((2 * NB, BS, HI, H), BF16), S((2 * NB, BS, HI, H), BF16),
             S((2, NB), I32), S((2, HI, 1, TOPK), I32), S((2,), I32)))


def _decode_select_fused():
    from m3jax.pallas.decode import decode_select_blocks

    return (lambda iq, ik, pt, sl: decode_select_blocks(iq, ik, pt, sl, block_size=BS, topk=TOPK),
            (S((2, 1, HI, H), BF16), S((2 * NB, BS, H), BF16), S((2, NB), I32), S((2,), I32)))


def _grouped_matmul():
    from m3jax.pallas.grouped_matmul import grouped_matmul

    return grouped_matmul, (S((4096, 1024), BF16), S((16, 1024, 512), BF16), S((16,), I32))


# kernel -> (function and abstract arguments, whether it multiplies on the tensor cores)
KERNELS = {
    "index_scores": (_index_scores, True),
    "index_scores_fp8": (_index_scores_fp8, True),
    "index_topk_fused": (_index_topk_fused, True),
    "topk_blockmajor": (lambda: _topk("pallas_blockmajor", T), False),
    "topk_rowsplit": (lambda: _topk("pallas_rowsplit", 1), False),
    "sparse_attention_kv_major": (lambda: _sparse_attention("kv_major"), True),
    "sparse_attention_query_major": (lambda: _sparse_attention("query_major"), True),
    "decode_index_scores": (_decode_index_scores, True),
    "decode_select_fused": (_decode_select_fused, True),
    "decode_index_scores_fp8": (_decode_index_scores_fp8, True),
    "decode_index_scores_registers": (lambda: _decode_registers(select=False), True),
    "decode_select_registers": (lambda: _decode_registers(select=True), True),
    "sparse_decode_attention": (_sparse_decode_attention, True),
    "grouped_matmul": (_grouped_matmul, True),
}


# kernels with a Blackwell variant (tcgen05 into TMEM), chosen through current_target().mma (the fused
# decode selection's is the fallback: the Blackwell decode scoring kernel, then the top-k kernel)
BLACKWELL_VARIANTS = {"index_scores", "index_scores_fp8", "index_topk_fused", "sparse_attention_kv_major",
                      "decode_index_scores", "decode_select_fused", "sparse_decode_attention", "grouped_matmul",
                      "decode_index_scores_registers", "decode_select_registers"}


# tcgen05.fence::before_thread_sync per kernel at M3's shapes: one per hand-off of TMEM from the
# warpgroup's loads or stores to the next MMA (_common.tmem_handoff), as the PTX ISA orders them.
# The index scoring hands its accumulator back once per key block (emitted twice: the pipeline over
# fully visible blocks and the causally masked one), the KV-major attention S and O once per tile (also
# emitted twice: tiles with and without a query's own block), the decode attention O's zeros, S and O's rescale once per page; the grouped GEMM reads its accumulator
# once, after the last MMA, and frees it.
FENCES = {"index_scores": 2, "index_scores_fp8": 2, "index_topk_fused": 2, "sparse_attention_kv_major": 4,
          "decode_index_scores": 1, "sparse_decode_attention": 3, "grouped_matmul": 0}


def _mma_instruction(name: str, mma: bool, target) -> str | None:
    if not mma:
        return None
    return "tcgen05.mma" if target.mma == "tcgen05" and name in BLACKWELL_VARIANTS else "wgmma.mma_async"


def test_every_selfcheck_kernel_is_lowered_here():
    # Machine: any: a list check
    from m3jax.pallas import canaries

    assert set(KERNELS) == set(canaries.KERNELS)


@contextlib.contextmanager
def captured_modules():
    """Every Mosaic GPU module lowered inside: two lists, each module's text just before Mosaic
    serialises it and the bytecode its custom call carries."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    texts, bytecodes, serde = [], [], mgpu_core._run_serde_pass

    def capture(module, *, serialize, **kw):
        if serialize:
            texts.append(str(module))
        module = serde(module, serialize=serialize, **kw)
        if serialize:
            buf = io.BytesIO()
            module.operation.write_bytecode(buf)
            bytecodes.append(buf.getvalue())
        return module

    mgpu_core._run_serde_pass = capture
    try:
        yield texts, bytecodes
    finally:
        mgpu_core._run_serde_pass = serde


@pytest.fixture
def mosaic_modules():
    """The text of every Mosaic GPU module lowered in the test (:func:`captured_modules`)."""
    with captured_modules() as (texts, _):
        yield texts


def lower_modules(make, target) -> tuple[str, list[tuple[str, bytes]]] | None:
    """``make()``'s function (traced as on ``target``) lowered for CUDA: its StableHLO text and every
    Mosaic GPU module it carries, as (text, bytecode) (:func:`captured_modules`); None where ``make``
    returns None (no path on that target)."""
    with captured_modules() as (texts, bytecodes), _backend.lowering_for(target):
        made = make()
        if made is None:
            return None
        f, args = made
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text, list(zip(texts, bytecodes))


@functools.cache
def lowered_kernel(name: str, target) -> tuple[str, list[tuple[str, bytes]]] | None:
    """:func:`lower_modules` of ``KERNELS[name]``, once per session: tests/pallas/test_compile.py
    compiles the same modules (lowering is most of both tests' time)."""
    return lower_modules(KERNELS[name][0], target)


def test_lowers_for_sm100a():
    # (Hopper: the same function with _backend.HOPPER passes too; test_compile.py lowers and compiles
    # them for sm_90a.)
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    target = _backend.BLACKWELL
    before = (_backend.current_target(), _backend.on_gpu())  # Hopper off-GPU and on the H200
    with _backend.lowering_for(target):
        assert _backend.current_target() is target
    assert (_backend.current_target(), _backend.on_gpu()) == before  # the override is undone
    for name, (_, mma) in KERNELS.items():
        lowered = lowered_kernel(name, target)
        if lowered is None:  # no path on this target
            continue
        text, mods = lowered[0], [m for m, _ in lowered[1]]
        assert text.count("custom_call @mosaic_gpu") >= 1, name
        assert mods and all("mosaic_gpu.arch_major = 10 : i32" in m for m in mods), name
        want = _mma_instruction(name, mma, target)
        for instruction in ("wgmma.mma_async", "tcgen05.mma"):
            assert any(instruction in m for m in mods) == (instruction == want), (name, instruction)
        if name in FENCES:  # in every module of the kernel (some lower more than one)
            assert {m.count("nvvm.tcgen05.fence <before>") for m in mods} == {FENCES[name]}, name


@pytest.mark.parametrize("bs,q,dtype", [(64, 1, BF16), (64, 32, BF16), (192, 2, F32), (256, 4, BF16)])
def test_blackwell_decode_scores_lower_at_other_tiles(bs, q, dtype, mosaic_modules):
    # 64-row MMA tiles (block 64: m3-small; 192: three of them, fp32 as bf16 pieces), two 128-row tiles
    # (block 256), and query tiles from 8 to 128 rows (N of the MMA).
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.decode import decode_index_scores

    nb = CTX // bs
    args = (S((2, q, HI, H), dtype), S((2 * nb, bs, H), dtype), S((2, nb), I32), S((2,), I32))
    with _backend.lowering_for(_backend.BLACKWELL):
        jax.jit(lambda *a: decode_index_scores(*a, block_size=bs)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "tcgen05.mma" in mosaic_modules[-1] and "wgmma" not in mosaic_modules[-1]


@pytest.mark.parametrize("b,ctx,ik_dtype", [(8, 1 << 20, BF16), (1, 1 << 20, BF16), (8, 1 << 20, jnp.float8_e4m3fn),
                                             (3, 307_200, BF16)])
@pytest.mark.parametrize("target", ["HOPPER", "BLACKWELL"])
def test_decode_score_select_lowers_at_m3_decode_shapes(target, b, ctx, ik_dtype):
    # The scoring kernel's transposed score tile and the row-split top-k reading it in place, at M3's
    # decode shapes: one wave of splits at batch 8 and 1M gives 455-512 pages per CTA, stored in TMA boxes
    # of at most 256 pages; 300K tokens at batch 3 leaves a chunk whose tile needs wider rows.
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.decode import decode_score_select

    nb = ctx // 128
    args = (S((b, 1, 4, 128), BF16), S((b * nb, 128, 128), ik_dtype), S((b, nb), I32), S((b,), I32))
    with _backend.lowering_for(getattr(_backend, target)):
        text = jax.jit(lambda *a: decode_score_select(*a, block_size=128, topk=16)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2  # the scoring kernel and the top-k


@pytest.mark.parametrize("hx,bs,dtype,fused", [(16, 64, BF16, False), (32, 256, F32, False), (64, 16, BF16, True),
                                               (128, 96, BF16, True), (128, 256, F32, False)])
def test_blackwell_index_scores_lower_at_other_tiles(hx, bs, dtype, fused, mosaic_modules):
    # index head dims 16 / 32 (32- and 64-byte swizzle) and 64 / 128; N = block 16 to 256 (256: the
    # accumulator read in four 64-column pieces; fp32 at 256: the half-block SMEM fallback, N = 128);
    # fp32 as three bf16 pieces; the fused top-k epilogue.
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.index_scores import IndexScoreConfig, index_block_scores, index_select_blocks

    args = (S((1, T, HI, hx), dtype), S((1, CTX, hx), dtype), S((1, T), I32))
    if fused:
        cfg = IndexScoreConfig(fused_topk=True)
        f = lambda iq, ik, p: index_select_blocks(iq, ik, p, block_size=bs, topk=TOPK, config=cfg)
    else:
        f = lambda iq, ik, p: index_block_scores(iq, ik, p, block_size=bs)
    with _backend.lowering_for(_backend.BLACKWELL):
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "tcgen05.mma" in mosaic_modules[0] and not any("wgmma" in m for m in mosaic_modules)


@pytest.mark.parametrize("bs,h,q,dtype", [(64, 64, 2, F32), (256, 256, 8, BF16), (256, 128, 1, F32)])
def test_blackwell_decode_attention_lowers_at_other_tiles(bs, h, q, dtype, mosaic_modules):
    # head dims 64..256 (O's TMEM columns, rescaled in 64-column pieces), Q * G = 32..128 rows, block
    # 256 as two 128-key tiles, fp32 as bf16 pieces (bf16x3).
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.decode import sparse_decode_attention

    nb = CTX // bs
    args = (S((2, q, HI * G, h), dtype), S((2 * nb, bs, HI, h), dtype), S((2 * nb, bs, HI, h), dtype),
            S((2, nb), I32), S((2, HI, q, TOPK), I32), S((2,), I32))
    with _backend.lowering_for(_backend.BLACKWELL):
        jax.jit(lambda *a: sparse_decode_attention(*a, block_size=bs)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "tcgen05.mma" in mosaic_modules[-1] and "wgmma" not in mosaic_modules[-1]


@pytest.mark.parametrize("g,h,bs,dtype", [(4, 32, 16, F32), (1, 64, 64, BF16), (16, 256, 256, BF16), (8, 128, 128, F32)])
def test_blackwell_kv_major_attention_lowers_at_other_tiles(g, h, bs, dtype, mosaic_modules):
    # head dims 32..256 (O read from TMEM in 64-column pieces; 256: 64-key blocks to fit SMEM), G 1
    # (padded to 8 rows per token) to 16, block 256 as 128-key kernel blocks, fp32 as bf16 pieces.
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.sparse_attention import sparse_attention

    args = (S((1, T, HI * g, h), dtype), S((1, CTX, HI, h), dtype), S((1, CTX, HI, h), dtype),
            S((1, HI, T, TOPK), I32), S((1, T), I32))
    with _backend.lowering_for(_backend.BLACKWELL):
        jax.jit(lambda *a: sparse_attention(*a, block_size=bs, implementation="kv_major")).trace(*args).lower(
            lowering_platforms=("cuda",))
    assert "tcgen05.mma" in mosaic_modules[-1] and "wgmma" not in mosaic_modules[-1]


# a wgmma whose A operand is four registers (after the accumulator's), not an SMEM descriptor
_WGMMA_REGISTER_A = re.compile(r"wgmma\.mma_async[^;]*\}, \{\$\d+,\$\d+,\$\d+,\$\d+\}, \$\d+, p")


@pytest.mark.parametrize("bs,dtype,fp8_mma,fp8_convert", [
    (128, BF16, "bfloat16", "smem"), (128, BF16, "float16", "smem"), (64, F32, "bfloat16", "smem"),
    (128, BF16, "bfloat16", "registers"), (256, BF16, "float16", "registers"), (64, F32, "bfloat16", "registers")])
@pytest.mark.parametrize("target", ["HOPPER", "BLACKWELL"])
def test_decode_scores_lower_with_fp8_pages(target, bs, dtype, fp8_mma, fp8_convert, mosaic_modules):
    # fp8 e4m3 index-key pages (index_cache_dtype): loaded by TMA as fp8, converted (e4m3x2 -> f16x2
    # cvt, then the query's 16-bit type) in SMEM for the MMA, or with fp8_convert="registers" on
    # Hopper in registers, the wgmma's A operand (Blackwell: SMEM, tcgen05 has no register A); fp32
    # queries as bf16 pieces; pages of 64 to 256 keys (one to four 64-row wgmma groups).
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.decode import DecodeScoreConfig, decode_index_scores

    target = getattr(_backend, target)
    nb = CTX // bs
    args = (S((2, 1, HI, H), dtype), S((2 * nb, bs, H), jnp.float8_e4m3fn), S((2, nb), I32), S((2,), I32))
    config = DecodeScoreConfig(fp8_mma=fp8_mma, fp8_convert=fp8_convert)
    with _backend.lowering_for(target):
        jax.jit(lambda *a: decode_index_scores(*a, block_size=bs, config=config)).trace(*args).lower(
            lowering_platforms=("cuda",))
    module = mosaic_modules[-1]
    assert "cvt.rn.f16x2.e4m3x2" in module and _mma_instruction("decode_index_scores", True, target) in module
    assert bool(_WGMMA_REGISTER_A.search(module)) == (fp8_convert == "registers" and target.mma == "wgmma")


@pytest.mark.parametrize("b,ik_dtype,fp8_mma,fp8_convert", [
    (1, BF16, "bfloat16", "smem"), (8, jnp.float8_e4m3fn, "bfloat16", "smem"),
    (1, jnp.float8_e4m3fn, "float16", "smem"), (8, jnp.float8_e4m3fn, "bfloat16", "registers")])
@pytest.mark.parametrize("target", ["HOPPER", "BLACKWELL"])
def test_fused_decode_select_lowers(target, b, ik_dtype, fp8_mma, fp8_convert, mosaic_modules):
    # The fused paged selection (decode_select_blocks) at M3's shapes: on Hopper two modules, the wgmma
    # scoring with the split's top-k lists carried through the page pipeline, then the top-k kernel
    # merging the splits' lists; Blackwell has no tcgen05 port of it and runs the scoring kernel and
    # the top-k kernel (two modules, no wgmma).
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.decode import DecodeScoreConfig, decode_select_blocks

    target = getattr(_backend, target)
    args = (S((b, 1, HI, H), BF16), S((b * NB, BS, H), ik_dtype), S((b, NB), I32), S((b,), I32))
    config = DecodeScoreConfig(fp8_mma=fp8_mma, fp8_convert=fp8_convert)
    start = len(mosaic_modules)
    with _backend.lowering_for(target):
        jax.jit(lambda *a: decode_select_blocks(*a, block_size=BS, topk=TOPK, init_blocks=1, force_in=(3,),
                                                force_out=(5,), config=config)).trace(*args).lower(
            lowering_platforms=("cuda",))
    mods = mosaic_modules[start:]
    if target.mma == "tcgen05":
        assert len(mods) == 2 and not any("wgmma" in m for m in mods)
    else:
        assert len(mods) == 2 and "wgmma.mma_async" in mods[0] and "wgmma" not in mods[1]
        assert bool(_WGMMA_REGISTER_A.search(mods[0])) == (fp8_convert == "registers")


_SMEM_VIEW = re.compile(r"memref\.view [^\n]*? to memref<((?:\d+x)+)(f32|i32|f8E4M3FN|bf16), "
                        r"#gpu\.address_space<workgroup>>")
_BYTES = {"f32": 4, "i32": 4, "bf16": 2, "f8E4M3FN": 1}


def _unaligned_slots(module: str) -> set[str]:
    """The module's SMEM buffers stacked along their leading dim (two slots or more) whose slots (one
    leading index) are not whole multiples of 128 bytes. Mosaic places each buffer at a 1 KiB boundary but a slot at the
    buffer's start plus the slot index times its bytes, and a TMA copy to or from SMEM faults
    (CUDA_ERROR_MISALIGNED_ADDRESS) at an address off 128 bytes."""
    bad = set()
    for dims, dtype in _SMEM_VIEW.findall(module):
        shape = [int(d) for d in dims.rstrip("x").split("x")]
        if len(shape) >= 2 and shape[0] > 1 and math.prod(shape[1:]) * _BYTES[dtype] % 128:
            bad.add(f"{dims}{dtype}")
    return bad


# tests/pallas/test_index_scores_fp8.py's tiles (its block 16 at Hx 64, 64 rows, 2 key buffers, groups of 2)
_TEST_TILE = dict(rows=64, group=2, max_concurrent_steps=2)


@pytest.mark.parametrize("hx,bs,fused,tile", [(128, 128, False, {}), (64, 256, True, {}), (32, 64, False, {}),
                                              (64, 16, False, _TEST_TILE), (64, 16, True, _TEST_TILE)])
@pytest.mark.parametrize("target", ["HOPPER", "BLACKWELL"])
def test_fp8_indexer_scores_lower(target, hx, bs, fused, tile, mosaic_modules):
    # The fp8 indexer (score_dtype="float8_e4m3fn"): e4m3 Q tiles and key blocks straight into an e4m3 x
    # e4m3 MMA (wgmma, K steps of 32; tcgen05 kind::f8f6f4), the key scales pipelined beside the keys;
    # head dims 32..128 (32- to 128-byte swizzles), block 16..256, the fused top-k epilogue. Every
    # pipeline slot and output buffer slot, which TMA fills or reads, at a 128-byte boundary: the key
    # scales' slots too (a block of 16 keys' fp32 scales is 64 bytes, padded to 128).
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.index_scores import IndexScoreConfig, index_block_scores, index_select_blocks

    target = getattr(_backend, target)
    args = (S((1, T, HI, hx), BF16), S((1, CTX, hx), BF16), S((1, T), I32))
    kw = dict(block_size=bs, score_dtype="float8_e4m3fn")
    config = IndexScoreConfig(fused_topk=fused, **tile)
    if fused:
        f = lambda iq, ik, p: index_select_blocks(iq, ik, p, topk=TOPK, config=config, **kw)
    else:
        f = lambda iq, ik, p: index_block_scores(iq, ik, p, config=config, **kw)
    with _backend.lowering_for(target):
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    mma = "tcgen05.mma.cta_group::1.kind::f8f6f4" if target.mma == "tcgen05" else ".f32.e4m3.e4m3"
    assert mma in mosaic_modules[0]
    assert not _unaligned_slots(mosaic_modules[0])


@pytest.mark.parametrize("hx,bs,q,fp8_convert", [(128, 128, 1, "smem"), (64, 64, 2, "smem"), (128, 256, 4, "smem"),
                                                  (128, 128, 1, "registers")])
def test_fp8_indexer_decode_scores_lower(hx, bs, q, fp8_convert, mosaic_modules):
    # The decode scoring kernel under the fp8 indexer over fp8 pages: the page as loaded is the wgmma's
    # A operand (e4m3 x e4m3, no conversion), the query tile swizzled as the page. fp8_convert="registers"
    # converts nothing here either: the A operand stays the SMEM page, not registers.
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.decode import DecodeScoreConfig, decode_index_scores

    nb = CTX // bs
    args = (S((2, q, HI, hx), BF16), S((2 * nb, bs, hx), jnp.float8_e4m3fn), S((2, nb), I32), S((2,), I32))
    kw = dict(block_size=bs, score_dtype="float8_e4m3fn", config=DecodeScoreConfig(fp8_convert=fp8_convert))
    with _backend.lowering_for(_backend.HOPPER):
        jax.jit(lambda *a: decode_index_scores(*a, **kw)).trace(*args).lower(lowering_platforms=("cuda",))
    module = mosaic_modules[-1]
    assert ".f32.e4m3.e4m3" in module and "e4m3x2" not in module
    assert not _WGMMA_REGISTER_A.search(module)
