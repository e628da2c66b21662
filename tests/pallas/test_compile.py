"""Every Mosaic GPU kernel compiled for sm_90a and sm_100a on a CPU machine, to PTX by jaxlib's own Mosaic
GPU compiler and assembled by ptxas, at M3's shapes (tests/pallas/test_lowering.py's KERNELS).

Lowering (test_lowering.py) stops at the serialised Mosaic module; PTX is made when XLA instantiates
the custom call, on a GPU. The CUDA PJRT plugin exports that same step as ``MosaicGpuCompile`` (the
entry jax's ``as_torch_gpu_kernel`` calls). Before it writes PTX it asks the driver only for the
current device and its compute capability, so a stand-in ``libcuda.so.1`` (built here from the C
below) that answers the target's compute capability and refuses to load modules lets it run without
a GPU; ``MOSAIC_GPU_DUMP_TO`` keeps the PTX, and ``ptxas -arch=sm_XXa -v`` assembles it.

Opt-in, as it needs the plugin (``pip download jax-cuda13-pjrt==<jax version> --no-deps``, unzipped):
``M3JAX_CUDA_PLUGIN`` names its ``xla_cuda_plugin.so`` (or the unzipped wheel's folder); ptxas (CUDA
>= 12.8) from ``M3JAX_PTXAS`` or the PATH; a C compiler for the stand-in. Without them the test skips
and says which is missing. It fails on a compile failure of a kernel the model picks on that target,
a ptxas error, or any spill, and prints registers, dynamic shared memory, spills and the tcgen05
fences per kernel and target. The query-major attention baseline (Hopper only: the model never
picks it on Blackwell) must fail for sm_100a, inside Mosaic (it issues wgmma).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from m3jax.pallas import _backend
from tests.pallas.test_lowering import KERNELS

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
SPILL_ALLOWANCE_BYTES = 0
# (kernel, arch) that must not compile: the query-major baseline's wgmma on Blackwell
EXPECTED_FAILURES = {("sparse_attention_query_major", "sm_100a"): "wgmma"}


def _plugin() -> Path | None:
    raw = os.environ.get("M3JAX_CUDA_PLUGIN")
    if not raw:
        return None
    path = Path(raw)
    return path if path.is_file() else path / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    plugin = _plugin()
    ptxas = os.environ.get("M3JAX_PTXAS") or shutil.which("ptxas")
    cc = shutil.which("cc") or shutil.which("gcc")
    if plugin is None or not plugin.is_file():
        pytest.skip("M3JAX_CUDA_PLUGIN is not set to the CUDA PJRT plugin's xla_cuda_plugin.so (pip download "
                    f"jax-cuda13-pjrt=={jax.__version__} --no-deps, unzip): nothing compiled to PTX")
    if not ptxas:
        pytest.skip("no ptxas (M3JAX_PTXAS or the PATH; CUDA >= 12.8): the PTX is not assembled")
    if not cc:
        pytest.skip("no C compiler for the stand-in libcuda.so.1")
    lib = tmp_path_factory.mktemp("standin")
    (lib / "libcuda.c").write_text(_STAND_IN_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"), str(lib / "libcuda.c")], check=True)
    return plugin, ptxas, lib


def _modules(name: str, target) -> list[tuple[str, bytes]]:
    """(text, bytecode) of every Mosaic module the kernel lowers to for ``target``: the text before
    Mosaic serialises it (its launch's dynamic SMEM), the bytes the custom call would carry."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    out, serde = [], mgpu_core._run_serde_pass

    def capture(module, *, serialize, **kw):
        text = str(module) if serialize else None
        module = serde(module, serialize=serialize, **kw)
        if serialize:
            buf = io.BytesIO()
            module.operation.write_bytecode(buf)
            out.append((text, buf.getvalue()))
        return module

    mgpu_core._run_serde_pass = capture
    try:
        with _backend.lowering_for(target):
            f, args = KERNELS[name][0]()
            jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        mgpu_core._run_serde_pass = serde
    return out


def _compile(toolchain, arch: str, cc: str, bytecode: bytes, work: Path) -> dict:
    plugin, ptxas, lib = toolchain
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
        return {"error": why[0].strip()[:300]}
    asm = subprocess.run([ptxas, f"-arch={arch}", "-v", str(ptx[0]), "-o", str(work / "out.cubin")],
                         capture_output=True, text=True, timeout=300)
    report = asm.stdout + asm.stderr
    if asm.returncode:
        return {"error": f"ptxas: {report.strip().splitlines()[-1][:300]}"}
    text = ptx[0].read_text()
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)), "spill_bytes": max(spills),
            "fences": text.count("tcgen05.fence::before_thread_sync"),
            "warnings": [ln for ln in report.splitlines() if "warning" in ln]}


def test_kernels_compile_for_sm90a_and_sm100a(toolchain, tmp_path):
    rows, problems = [], []
    for arch, (target, cc) in TARGETS.items():
        for name in KERNELS:
            for i, (text, bytecode) in enumerate(_modules(name, target)):
                r = _compile(toolchain, arch, cc, bytecode, tmp_path / f"{arch}-{name}-{i}")
                smem = re.search(r"dynamic_shared_memory_size %c(\d+)_i32", text)
                r["smem"] = int(smem.group(1)) if smem else None
                rows.append((name if i == 0 else f"{name} [{i}]", arch, r))
                expected = EXPECTED_FAILURES.get((name, arch))
                if expected:
                    if "error" not in r or expected not in r["error"]:
                        problems.append(f"{name} on {arch}: expected a failure naming {expected!r}, got {r}")
                elif "error" in r:
                    problems.append(f"{name} on {arch}: {r['error']}")
                elif r["spill_bytes"] > SPILL_ALLOWANCE_BYTES or r["warnings"]:
                    problems.append(f"{name} on {arch}: {r['spill_bytes']} B spilled, warnings {r['warnings']}")
    print("\nkernel                              arch     registers  dynamic smem  spills  tcgen05 fences")
    for name, arch, r in rows:
        if "error" in r:
            print(f"{name:35} {arch:8} {r['error']}")
        else:
            print(f"{name:35} {arch:8} {r['registers']:9}  {r['smem']!s:>12}  {r['spill_bytes']:6}  {r['fences']:14}")
    assert not problems, "\n".join(problems)
