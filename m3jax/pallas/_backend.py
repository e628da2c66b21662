"""The one thin layer between m3jax kernels and Pallas Mosaic GPU.

Mosaic GPU's Python API moves every JAX release ("can change weekly"), so every kernel imports
Pallas through here: ``plgpu``/``pl`` aliases, the launch wrapper (``mosaic_kernel``) that switches to
GPU interpret mode off-GPU, and the target description. Porting to a new JAX release means editing
this file first.

Targets. ``Target.HOPPER`` (sm_90a: wgmma, TMA, 227 KiB SMEM per block) is what we test on (H200).
``Target.BLACKWELL`` (sm_100: tcgen05 MMA with TMEM accumulators, 2-CTA clusters, TMA gather) is what
the model is served on; kernels read their tile shapes and MMA choice from the target so the B200
path is a configuration: ``mma="tcgen05"`` accumulates in TMEM (``plgpu.TMEM``) instead of
registers, ``cluster=2`` pairs CTAs on one 256-row tile, ``tma_gather`` loads the 16 selected KV
blocks in one indexed TMA instead of 16 copies.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for kernels)
from jax.experimental.pallas import mosaic_gpu as plgpu


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    mma: str  # "wgmma" (Hopper, register accumulators) | "tcgen05" (Blackwell, TMEM accumulators)
    smem_bytes: int
    num_sms: int
    cluster: int = 1  # CTAs cooperating on one tile (2 on Blackwell's 2-CTA MMA)
    tma_gather: bool = False  # indexed TMA of many rows in one copy (Blackwell only)


HOPPER = Target("sm_90a", mma="wgmma", smem_bytes=232_448, num_sms=132)
BLACKWELL = Target("sm_100a", mma="tcgen05", smem_bytes=232_448, num_sms=148, cluster=2, tma_gather=True)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def current_target() -> Target:
    """The target of the default GPU (Hopper off-GPU: interpret mode simulates Hopper semantics)."""
    if on_gpu():
        major = int(getattr(jax.devices()[0], "compute_capability", "9.0").split(".")[0])
        return BLACKWELL if major >= 10 else HOPPER
    return HOPPER


def interpret_params(detect_races: bool = True):
    """GPU interpret mode for CPU tests: simulated SMEM, barriers, TMA and a race detector."""
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def mosaic_kernel(body, *, interpret: bool | None = None, detect_races: bool = True, **kwargs):
    """``plgpu.kernel`` that runs in GPU interpret mode when no GPU is present (or when asked).

    ``kwargs`` are ``plgpu.kernel``'s: out_type, scratch_types, grid, grid_names, num_threads,
    thread_name, cluster, compiler_params.
    """
    if interpret is None:
        interpret = not on_gpu()
    if interpret:
        kwargs["interpret"] = interpret_params(detect_races)
    return plgpu.kernel(body, **kwargs)


def interpret_races_found() -> bool:
    """Whether the interpret-mode race detector has reported a race since the last reset."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    races = getattr(gpu_callbacks, "_races", None)  # None until the first interpreted kernel
    return bool(races is not None and races.races_found)


def reset_interpret_state() -> None:
    """Clear interpret-mode state (races, simulated memory); needed after a kernel raised."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.reset_gpu_interpret_mode_state()
