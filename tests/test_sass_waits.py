"""benchmarks/sass_waits.py's readers of SASS and ptxas reports, on hand-written excerpts in nvdisasm's and
ptxas's formats."""

from __future__ import annotations

from benchmarks.sass_waits import hgmma_groups, ptxas_summary

SERIALIZED = """
        /*4900*/                   WARPGROUP.ARRIVE ;
        /*49b0*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR28].tnspB, R88, gsb0 ;
        /*4a40*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*4a50*/                   WARPGROUP.ARRIVE ;
        /*4a60*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR24].tnspB, R88, gsb0 ;
        /*4a70*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""
PIPELINED = """
        /*4a80*/                   WARPGROUP.ARRIVE ;
        /*4a90*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR28].tnspB, R88 ;
        /*4aa0*/                   UIADD3.64 UR28, UR24, 0x1fe, URZ ;
        /*4ab0*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR24].tnspB, R88 ;
        /*4ac0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16].tnspB, R24, gsb0 ;
        /*4b90*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
"""


def test_hgmma_groups_tells_serialized_from_pipelined():
    assert hgmma_groups(SERIALIZED) == (2, 2, 2)
    assert hgmma_groups(PIPELINED) == (3, 1, 0)


def test_ptxas_summary():
    report = """ptxas info    : (C7519) warpgroup.arrive is injected in around line 9 by compiler
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized
ptxas info    : (C7519) warpgroup.arrive is injected in around line 20 by compiler
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers"""
    assert ptxas_summary(report) == "168 regs, spill 12 B, C7511 C7519"
    assert ptxas_summary("ptxas info    : Used 40 registers") == "40 regs, spill 0 B, -"
