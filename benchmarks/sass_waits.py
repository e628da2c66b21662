"""Whether ptxas serialized a Mosaic GPU kernel's wgmmas, read off its SASS (CPU, after a GPU dump).

ptxas answers some kernel structures by waiting for every ``HGMMA`` before issuing the next (its message
C7511): on 2026-12-03 the warp-specialised grouped GEMM did, because of an always-true branch around its
MMAs (``benchmarks/RESULTS.md``, fourteenth session). The device has no ``nvdisasm``, so the check is
split in two:

1. On the GPU, any run with Mosaic GPU's dumps on writes each kernel's PTX and ptxas report::

       mkdir -p $OUT/dump
       MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/dump PYTHONPATH=. python3 benchmarks/<script>.py
       cd $OUT && tar czf dump.tgz dump/*.ptx dump/*.ptxas     # the MLIR dumps beside them are large

2. Here, with ``ptxas`` (CUDA 12.3+, sm_90a) and ``nvdisasm`` in ``--bin`` or on the PATH (PyPI's
   ``nvidia-cuda-nvdisasm`` wheel carries one)::

       python benchmarks/sass_waits.py DUMP_DIR [--bin DIR]

For each ``*.ptx`` it prints ptxas's registers, spill bytes and C75xx messages, and of the SASS the
number of ``HGMMA`` instructions, of wgmma groups they close (an HGMMA with the ``gsb0`` operand) and of
waits for every group (``WARPGROUP.DEPBAR.LE gsb0, 0x0``). Serialized wgmmas close a group each and each
is waited for: the grouped GEMM before the fix had 8 HGMMAs in 8 groups with 8 such waits, after it 8 in
1 group, one such wait (its epilogue's) and one ``0x1`` (the previous step's group).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def hgmma_groups(sass: str) -> tuple[int, int, int]:
    """(HGMMA instructions, those closing a wgmma group (``gsb0`` operand), waits for every group
    (``WARPGROUP.DEPBAR.LE gsb0, 0x0``)). Serialized wgmmas close a group each and are waited for each."""
    mmas = re.findall(r"HGMMA\.[^;]*;", sass)
    return len(mmas), sum("gsb0" in m for m in mmas), len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass))


def ptxas_summary(report: str) -> str:
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    codes = sorted(set(re.findall(r"\((C75\d\d)\)", report)))
    return f"{regs.group(1) if regs else '?'} regs, spill {spill.group(1) if spill else 0} B, {' '.join(codes) or '-'}"


def _tool(name: str, bin_dir: str | None) -> str:
    search = os.pathsep.join(filter(None, [bin_dir, os.environ.get("PATH")]))
    path = shutil.which(name, path=search)
    if path is None:
        sys.exit(f"sass_waits.py: {name} not found in {search!r} (see --bin)")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", type=Path, help="a directory of Mosaic GPU's *.ptx dumps")
    ap.add_argument("--bin", help="a directory searched for ptxas and nvdisasm before the PATH")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args()
    ptxas, nvdisasm = _tool("ptxas", args.bin), _tool("nvdisasm", args.bin)
    files = sorted(args.dump.glob("*.ptx"))
    if not files:
        sys.exit(f"sass_waits.py: no *.ptx in {args.dump}")
    print("| kernel | ptxas | HGMMA | groups | waits for all |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for ptx in files:
            cubin = Path(tmp) / (ptx.stem + ".cubin")
            built = subprocess.run([ptxas, f"-arch={args.arch}", "-v", str(ptx), "-o", str(cubin)],
                                   capture_output=True, text=True)
            if built.returncode:
                print(f"| {ptx.stem} | ptxas failed: {built.stderr.strip().splitlines()[-1]} | | | |")
                continue
            sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            n, groups, waits = hgmma_groups(sass)
            print(f"| {ptx.stem} | {ptxas_summary(built.stderr)} | {n} | {groups} | {waits} |")


if __name__ == "__main__":
    main()
