"""Every Mosaic GPU kernel compiled for sm_90a and sm_100a on a CPU machine, to PTX by jaxlib's own Mosaic
GPU compiler and assembled by ptxas: at M3's shapes (tests/pallas/test_lowering.py's KERNELS, and the MoE
layer's grouped-GEMM configs at M3's expert shapes) and at every self-check canary's tile path
(m3jax.pallas.canaries, traced as the canary calls the kernel).

Machine: a CPU machine (CI) standing in for an sm_90a / sm_100a GPU; no GPU is used or needed.

Lowering (test_lowering.py) stops at the serialised Mosaic module; PTX is made when XLA instantiates
the custom call, on a GPU. The CUDA PJRT plugin exports that same step as ``MosaicGpuCompile`` (the
entry jax's ``as_torch_gpu_kernel`` calls). Before it writes PTX it asks the driver only for the
current device and its compute capability, so a stand-in ``libcuda.so.1`` (built here from the C
below) that answers the target's compute capability and refuses to load modules lets it run without
a GPU; ``MOSAIC_GPU_DUMP_TO`` keeps the PTX, and ``ptxas -arch=sm_XXa -v`` assembles it.

The tools: ``scripts/fetch_cuda_compile_tools.sh`` (tests/run_tests.sh runs it) puts the plugin
(``jax-cuda13-pjrt`` of this jax version) and ptxas (CUDA 13.0, the ``nvidia-cuda-nvcc`` wheel) under
``.venvs/cuda-compile``, where this test finds them; ``M3JAX_CUDA_PLUGIN`` (its ``xla_cuda_plugin.so`` or
the unzipped wheel's folder) and ``M3JAX_PTXAS`` override that. A C compiler builds the stand-in. Without
them the test skips and says which is missing. Results are kept under ``.venvs/cuda-compile/results``:
per module and arch (a module that did not change is not compiled again), and the whole table per
hash of the kernels' sources, the cases, jax and the tools (unchanged sources are not even traced).

It fails on a compile failure of a kernel the model picks on that target, a ptxas error, or any spill
not in ``SPILL_ALLOWED`` (with its reason), and prints registers, dynamic shared memory, spills and
the tcgen05 fences per kernel and target (benchmarks/RESULTS.md#compile-canaries). The query-major
attention baseline (Hopper only: the model never picks it on Blackwell) must fail for sm_100a, inside
Mosaic (it issues wgmma).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from m3jax.pallas import _backend, canaries
from tests.pallas.test_lowering import BF16, BS, H, HI, I32, KERNELS, NB, TOPK, S, lower_modules, lowered_kernel

_STAND_IN_LIBCUDA = r"""
#include <stdlib.h>
typedef int CUresult;
typedef int CUdevice;
static int cc(int minor) {  /* "10.0" from M3JAX_STANDIN_CC */
  const char *s = getenv("M3JAX_STANDIN_CC"), *dot = s;
  while (dot && *dot && *dot != '.') dot++;
  return minor ? (dot && *dot ? atoi(dot + 1) : 0) : (s ? atoi(s) : 0);
}
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { *d = 0; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuCtxGetDevice(CUdevice *d) { *d = 0; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {  /* 75, 76: compute capability */
  *v = attr == 75 ? cc(0) : attr == 76 ? cc(1) : 0;
  return 0;
}
CUresult cuModuleLoadData(void *m, const void *image) { return 999; }
CUresult cuModuleLoadDataEx(void *m, const void *image, unsigned n, void *o, void **v) { return 999; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "stand-in libcuda: no GPU"; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { *s = "CUDA_ERROR_STAND_IN"; return 0; }
"""

# Run in a process of its own per module: the plugin reads MOSAIC_GPU_DUMP_TO when it loads, and a
# Mosaic failure may abort.
_COMPILE = """
import ctypes, sys
dll = ctypes.CDLL(sys.argv[1])
compile_ = dll.MosaicGpuCompile
compile_.argtypes, compile_.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.POINTER(ctypes.c_void_p)
data = open(sys.argv[2], "rb").read()
compile_(data, len(data))  # null: the stand-in refuses to load the module; the PTX is dumped by then
"""

TARGETS = {"sm_90a": (_backend.HOPPER, "9.0"), "sm_100a": (_backend.BLACKWELL, "10.0")}
# (case, arch) -> (bytes, why) of a spill accepted up to that many bytes. The grouped GEMM's
# warp-specialised schedule (the MoE prefill's on Hopper; block 128 x 256, two consumer warpgroups: MXFP8's
# prefill tile) sits at ptxas's 168 registers per thread and spills a few bytes: measured with its spills,
# it is still MXFP8's fastest prefill tile (smaller tiles spill less and run slower,
# benchmarks/RESULTS.md#compile-canaries, #gmm-rows256). Every other module compiles with no spill.
_WS_SPILL = "warp-specialised grouped GEMM at the 168-register cap; MXFP8's fastest prefill tile with it"
# the 256-row tiles (two accumulators per consumer, two pipelines: full and short visits; bf16's prefill
# tile): ptxas 13.0's spills lie outside the K loops (SASS, CPU), a few loads per work item
_ROWS256_SPILL = "grouped GEMM 256-row tiles at the 168-register cap; the spills lie outside the K loops"
# the 384-row tiles (bf16's prefill tile from 224 rows per expert): the 256-row tiles' spill, and with it
# faster than them on the H100 (benchmarks/RESULTS.md#gmm-rows384)
_ROWS384_SPILL = "grouped GEMM 384-row tiles: the 256-row tiles' 24 bytes; measured faster than those with it"
# the same on two-CTA clusters (opt-in): more of the producer's and each item's bookkeeping (cluster barrier
# addresses) spilled; GPU timing pending
_CLUSTER_SPILL = "grouped GEMM 256-row tiles on clusters (opt-in): producer and per-item bookkeeping spilled"
SPILL_ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("canary grouped_matmul@bf16 [1]", "sm_90a"): (12, _WS_SPILL),  # the 128 x 256 prefill tile
    # [2], [3]: bf16 on the 256- and 384-row tiles, no spill at the canary's K = 128
    ("canary grouped_matmul@mxfp8 [1]", "sm_90a"): (28, _WS_SPILL),  # the 128 x 256 tile
    ("canary grouped_matmul@mxfp8 [2]", "sm_90a"): (16, _ROWS256_SPILL),  # the 256-row tiles
    # bf16 at 16K tokens (512 rows per expert): the layer's 384-row tiles, which spill as the 256-row ones
    ("m3 grouped_matmul prefill", "sm_90a"): (24, _ROWS384_SPILL),
    ("m3 grouped_matmul prefill mxfp8", "sm_90a"): (28, _WS_SPILL),  # MXFP8: the layer's 128 x 256 tile
    ("m3 grouped_matmul prefill 256-row tiles", "sm_90a"): (24, _ROWS256_SPILL),  # PREFILL_ROWS256
    ("m3 grouped_matmul prefill 256-row tiles mxfp8", "sm_90a"): (28, _ROWS256_SPILL),
    ("m3 grouped_matmul prefill 4096-token chunk", "sm_90a"): (24, _ROWS256_SPILL),  # 128 rows per expert
    ("m3 grouped_matmul prefill 4096-token chunk mxfp8", "sm_90a"): (28, _WS_SPILL),
    ("m3 grouped_matmul prefill cluster", "sm_90a"): (160, _CLUSTER_SPILL),
    ("m3 grouped_matmul prefill cluster mxfp8", "sm_90a"): (256, _CLUSTER_SPILL),
}
# (kernel, arch) that must not compile: the query-major baseline's wgmma on Blackwell
EXPECTED_FAILURES = {("sparse_attention_query_major", "sm_100a"): "wgmma"}
_TOOLS = Path(__file__).resolve().parents[2] / ".venvs" / "cuda-compile"  # scripts/fetch_cuda_compile_tools.sh


def _m3_moe(mx: bool, m: int, config=None, per_row: bool = False):
    """The MoE layer's grouped GEMM at M3's expert shapes (hidden 6144 -> 3072 per expert, 128 experts)
    with the config the layer picks for ``m`` rows (m3jax.moe: 4 rows per token), or ``config`` (None where
    the target refuses it): bf16 or MXFP8 weights. ``per_row``: one decode token's rows, a group id per row
    (``RowGroups``) in place of the group sizes; bf16 as the layer runs its gate and up then: one launch of
    two weights, each the routed experts and the shared one (``m3jax.moe._token_mlps``)."""
    from m3jax.pallas.grouped_matmul import (RowGroups, grouped_matmul, grouped_matmul_mxfp8, grouped_matmuls,
                                             layer_config, mxfp8_unsupported_reason, unsupported_reason)

    S, (k, n, g) = jax.ShapeDtypeStruct, (6144, 3072, 128)
    if config is not None and (mxfp8_unsupported_reason(m, k, n, g, k // 32, config) if mx
                               else unsupported_reason(m, k, n, g, config)):
        return None
    config = config or layer_config(m, k, n, g, k // 32 if mx else None)
    groups, sizes = (RowGroups, S((m,), jnp.int32)) if per_row else (lambda gs: gs, S((g,), jnp.int32))
    if mx:
        return (lambda x, w, sc, gs: grouped_matmul_mxfp8(x, w, sc, groups(gs), config=config),
                (S((m, k), jnp.bfloat16), S((g, k, n), jnp.float8_e4m3fn), S((g, k // 32, n), jnp.uint8), sizes))
    if per_row:
        weight = (S((g, k, n), jnp.bfloat16), S((1, k, n), jnp.bfloat16))
        return (lambda x, w, gs: grouped_matmuls(x, w, RowGroups(gs), config=config),
                (S((m + 1, k), jnp.bfloat16), (weight, weight), S((m + 1,), jnp.int32)))
    return (lambda x, w, gs: grouped_matmul(x, w, groups(gs), config=config),
            (S((m, k), jnp.bfloat16), S((g, k, n), jnp.bfloat16), sizes))


def _m3_projections(m: int):
    """A decode step's attention projections at M3's widths (hidden 6144 -> q 64 x 128, k, v and the index
    q 4 x 128) as the model runs them on the dense gemv, ``m`` rows."""
    from m3jax.pallas.grouped_matmul import dense_gemvs

    S = jax.ShapeDtypeStruct
    widths = (8192, 512, 512, 512)
    return (lambda x, *ws: dense_gemvs(x, ws),
            (S((m, 6144), jnp.bfloat16), *(S((6144, n), jnp.bfloat16) for n in widths)))


# case -> (kernel, function and abstract arguments): M3's shapes, then every canary's tile path
CASES = {f"m3 {name}": (name, make) for name, (make, _) in KERNELS.items()}
CASES.update({"m3 grouped_matmul prefill": ("grouped_matmul", lambda: _m3_moe(False, 65536)),  # 16K tokens
              "m3 grouped_matmul prefill mxfp8": ("grouped_matmul", lambda: _m3_moe(True, 65536)),
              "m3 grouped_matmul prefill 4096-token chunk": ("grouped_matmul", lambda: _m3_moe(False, 16384)),
              "m3 grouped_matmul prefill 4096-token chunk mxfp8": ("grouped_matmul", lambda: _m3_moe(True, 16384)),
              "m3 grouped_matmul decode mxfp8": ("grouped_matmul", lambda: _m3_moe(True, 32)),
              # one decode token: a visit per row of group ids[r] (RowGroups; pipeline, MXFP8 on the gemv)
              "m3 grouped_matmul decode token": ("grouped_matmul", lambda: _m3_moe(False, 4, per_row=True)),
              "m3 grouped_matmul decode token mxfp8": ("grouped_matmul", lambda: _m3_moe(True, 4, per_row=True)),
              "m3 dense gemv, 8 rows": ("grouped_matmul", lambda: _m3_projections(8))})
# fp8 e4m3 index pages (index_cache_dtype) at M3's decode shapes, converted into an SMEM page (the
# default; KERNELS has the register-A conversion and the fp8 indexer's e4m3 x e4m3 scoring)
CASES.update({f"m3 {kernel} fp8 smem": (kernel, lambda k=kernel: _m3_decode_fp8(k))
              for kernel in ("decode_index_scores", "decode_select_fused")})
# the 256-row tiles (bf16's prefill tile, MXFP8's opt-in), alone and on two-CTA clusters (GroupedMatmulConfig.cluster;
# opt-in; Hopper only), 8192 tokens
_ROWS256 = dict(block_m=256, block_n=128, schedule="warp_specialized", wg_split="m")
_CLUSTER = dict(_ROWS256, cluster=2)
CASES.update({f"m3 grouped_matmul prefill 256-row tiles{' mxfp8' * mx}": (
    "grouped_matmul", lambda mx=mx: _m3_moe(mx, 32768, _gmm_config(**_ROWS256))) for mx in (False, True)})
CASES.update({f"m3 grouped_matmul prefill cluster{' mxfp8' * mx}": (
    "grouped_matmul", lambda mx=mx: _m3_moe(mx, 32768, _gmm_config(**_CLUSTER))) for mx in (False, True)})
# (a canary of a path the target does not have, Canary.unsupported, is not traced for it: its verdict is "n/a")
CASES.update({f"canary {c.name}": (c.kernel, lambda c=c: None if c.unsupported and c.unsupported() else (c.run, ()))
              for c in canaries.CANARIES.values()})
# tests/pallas/test_index_scores_fp8.py's kernel calls at its shapes and tiles (block 16, Hx 64, 64 rows)
CASES.update({f"test index_scores_fp8{' fused' * fused}": ("index_scores_fp8", lambda fused=fused: _fp8_test(fused))
              for fused in (False, True)})


def _fp8_test(fused: bool):
    from m3jax.pallas.index_scores import index_block_scores, index_select_blocks
    from tests.pallas import test_index_scores_fp8 as t

    kw = dict(block_size=t.BS, score_dtype=t.FP8)
    args = jax.eval_shape(lambda: t._case(False, 0))  # (iq, ik, q_pos) of the test's shapes
    if fused:  # the fused top-k kernel (its test's selection arguments)
        return (lambda iq, ik, p: index_select_blocks(iq, ik, p, config=t.CFG_FUSED, topk=4, local_blocks=2,
                                                      init_blocks=1, force_in=(1,), force_out=(2,), **kw), args)
    return (lambda iq, ik, p: index_block_scores(iq, ik, p, config=t.CFG, **kw), args)


def _m3_decode_fp8(kernel: str):
    """The decode index scoring or the fused selection (``kernel``) over fp8 e4m3 index pages, at
    test_lowering.py's decode shapes (two requests of 8192 tokens, bf16 queries), the keys converted
    in SMEM."""
    from m3jax.pallas.decode import decode_index_scores, decode_select_blocks

    args = (S((2, 1, HI, H), BF16), S((2 * NB, BS, H), jnp.float8_e4m3fn), S((2, NB), I32), S((2,), I32))
    if kernel == "decode_index_scores":
        return lambda iq, ik, pt, sl: decode_index_scores(iq, ik, pt, sl, block_size=BS), args
    return lambda iq, ik, pt, sl: decode_select_blocks(iq, ik, pt, sl, block_size=BS, topk=TOPK), args


def _gmm_config(**kw):
    from m3jax.pallas.grouped_matmul import GroupedMatmulConfig

    return GroupedMatmulConfig(**kw)


def _plugin() -> Path | None:
    raw = os.environ.get("M3JAX_CUDA_PLUGIN")
    if not raw:
        found = sorted((_TOOLS / f"jax-cuda13-pjrt-{jax.__version__}").glob("**/xla_cuda_plugin.so"))
        return found[0] if found else None
    path = Path(raw)
    return path if path.is_file() else path / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"


def _ptxas() -> str | None:
    found = sorted((_TOOLS / "nvcc").glob("**/bin/ptxas"))
    return os.environ.get("M3JAX_PTXAS") or (str(found[0]) if found else None) or shutil.which("ptxas")


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    plugin, ptxas = _plugin(), _ptxas()
    cc = shutil.which("cc") or shutil.which("gcc")
    fetch = "scripts/fetch_cuda_compile_tools.sh fetches it into .venvs/cuda-compile"
    if plugin is None or not plugin.is_file():
        pytest.skip(f"no CUDA PJRT plugin (jax-cuda13-pjrt=={jax.__version__}; {fetch}, or set M3JAX_CUDA_PLUGIN "
                    f"to its xla_cuda_plugin.so): nothing compiled to PTX")
    if not ptxas:
        pytest.skip(f"no ptxas (CUDA >= 12.8; {fetch}, or M3JAX_PTXAS / the PATH): the PTX is not assembled")
    if not cc:
        pytest.skip("no C compiler for the stand-in libcuda.so.1")
    lib = tmp_path_factory.mktemp("standin")
    (lib / "libcuda.c").write_text(_STAND_IN_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"), str(lib / "libcuda.c")], check=True)
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    return plugin, ptxas, lib, (version or ["?"])[0]


def _compile(toolchain, arch: str, cc: str, bytecode: bytes, work: Path) -> dict:
    plugin, ptxas, lib, version = toolchain
    key = hashlib.sha256(b"\0".join([arch.encode(), version.encode(), str(plugin).encode(), bytecode])).hexdigest()
    cached = _TOOLS / "results" / f"{key[:32]}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    (work / "dump").mkdir(parents=True)  # the plugin does not create it
    (work / "module.mlirbc").write_bytes(bytecode)
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(lib), os.environ.get("LD_LIBRARY_PATH")])),
               M3JAX_STANDIN_CC=cc, MOSAIC_GPU_DUMP_TO=str(work / "dump"))
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(plugin), str(work / "module.mlirbc")], env=env,
                         capture_output=True, text=True, timeout=300)
    ptx = sorted((work / "dump").glob("*.ptx"))
    if not ptx:
        lines = (run.stderr + run.stdout).splitlines()
        why = [ln for ln in lines if "not supported" in ln or "error:" in ln] or lines[-1:] or ["no PTX written"]
        return {"error": why[0].strip()[:300]}  # not cached: a failure is looked at afresh
    asm = subprocess.run([ptxas, f"-arch={arch}", "-v", str(ptx[0]), "-o", str(work / "out.cubin")],
                         capture_output=True, text=True, timeout=300)
    report = asm.stdout + asm.stderr
    if asm.returncode:
        return {"error": f"ptxas: {report.strip().splitlines()[-1][:300]}"}
    text = ptx[0].read_text()
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    result = {"registers": int(re.search(r"Used (\d+) registers", report).group(1)), "spill_bytes": max(spills),
              "fences": text.count("tcgen05.fence::before_thread_sync"),
              "warnings": [ln for ln in report.splitlines() if "warning" in ln]}
    if _TOOLS.is_dir():
        cached.parent.mkdir(exist_ok=True)
        cached.write_text(json.dumps(result))
    return result


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "does not compile"
    return f"{r['registers']:4} {r['smem'] if r['smem'] else '?':>7} {r['spill_bytes']:3} B {r['fences']:2}"


def _sources_key(toolchain) -> str:
    """What the table depends on: the kernels' and references' sources, the cases (this file and
    test_lowering.py), jax and the tools."""
    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "m3jax" / "pallas").rglob("*.py")) + [root / "m3jax" / "msa" / "reference.py",
                                                               Path(__file__).resolve(),
                                                               Path(__file__).with_name("test_lowering.py")]
    h = hashlib.sha256(f"{jax.__version__}|{toolchain[0]}|{toolchain[3]}".encode())
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _table(toolchain, tmp_path) -> list[tuple[str, str, dict]]:
    """(case, arch, result with its dynamic SMEM) of every module; the whole table is kept under
    .venvs/cuda-compile/results for these sources, and each module's result for its bytes."""
    table = _TOOLS / "results" / f"table-{_sources_key(toolchain)}.json"
    if table.is_file():
        return [tuple(row) for row in json.loads(table.read_text())]
    jobs = []  # (case, arch, text, bytecode)
    done = {}  # (arch, bytecode) -> its compile: identical modules (same kernel, shapes, tiles) compile once
    # Each module compiles (in a process of its own) as soon as it is lowered, while the next cases lower
    # here: lowering is most of the work, and serial (benchmarks/RESULTS.md#suite-time-2026-12-07).
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for arch, (target, _) in TARGETS.items():
            for case, (kernel, make) in CASES.items():
                kernel_case = case == f"m3 {kernel}" and kernel in KERNELS  # test_lowering.py's, lowered once
                lowered = lowered_kernel(kernel, target) if kernel_case else lower_modules(make, target)
                for i, (text, bytecode) in enumerate(lowered[1] if lowered else []):
                    jobs.append((case if i == 0 else f"{case} [{i}]", arch, text, bytecode))
                    if (arch, bytecode) not in done:
                        done[(arch, bytecode)] = pool.submit(_compile, toolchain, arch, TARGETS[arch][1], bytecode,
                                                             tmp_path / f"m{len(done)}")
    out = []
    for case, arch, text, bytecode in jobs:
        smem = re.search(r"dynamic_shared_memory_size %c(\d+)_i32", text)
        out.append((case, arch, dict(done[(arch, bytecode)].result(), smem=int(smem.group(1)) if smem else None)))
    if _TOOLS.is_dir() and not any("error" in r and (CASES[c.split(" [")[0]][0], a) not in EXPECTED_FAILURES
                                   for c, a, r in out):  # a table with a failure is made afresh next time
        table.parent.mkdir(exist_ok=True)
        table.write_text(json.dumps(out))
    return out


def test_kernels_compile_for_sm90a_and_sm100a(toolchain, tmp_path):
    # Machine: a CPU machine (CI) compiling for sm_90a and sm_100a GPUs it does not have.
    table = _table(toolchain, tmp_path)
    rows: dict[str, dict[str, dict]] = {}
    problems = []
    for case, arch, r in table:
        rows.setdefault(case, {})[arch] = r
        kernel = CASES[case.split(" [")[0]][0]
        expected = EXPECTED_FAILURES.get((kernel, arch))
        if expected:
            if "error" not in r or expected not in r["error"]:
                problems.append(f"{case} on {arch}: expected a failure naming {expected!r}, got {r}")
        elif "error" in r:
            problems.append(f"{case} on {arch}: {r['error']}")
        elif r["warnings"] or r["spill_bytes"] > SPILL_ALLOWED.get((case, arch), (0, ""))[0]:
            problems.append(f"{case} on {arch}: {r['spill_bytes']} B spilled, warnings {r['warnings']}")
    print(f"\n{toolchain[3]}; jax {jax.__version__}; {len(table)} modules")
    print(f"{'case':52} {'sm_90a: regs, dynamic smem (B), spill, fences':46} sm_100a: the same")
    for case, by_arch in rows.items():
        print(f"{case:52} {_cell(by_arch.get('sm_90a')):46} {_cell(by_arch.get('sm_100a'))}")
    for case, by_arch in rows.items():
        for arch, r in by_arch.items():
            if "error" in r:
                print(f"{case} on {arch}: {r['error']}")
            elif r["spill_bytes"] and (case, arch) in SPILL_ALLOWED:
                print(f"{case} on {arch}: {r['spill_bytes']} B spilled, allowed: {SPILL_ALLOWED[(case, arch)][1]}")
    assert not problems, "\n".join(problems)
