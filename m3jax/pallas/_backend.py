"""The one thin layer between m3jax kernels and Pallas Mosaic GPU.

Mosaic GPU's Python API moves every JAX release ("can change weekly"), so every kernel imports
Pallas through here: ``plgpu``/``pl`` aliases, the launch wrapper (``mosaic_kernel``) that switches to
GPU interpret mode off-GPU, and the target description. Porting to a new JAX release means editing
this file first.

Targets. The kernels here are Hopper kernels (sm_90a: TMA, 232,448 B of SMEM per block, and wgmma
with register accumulators in all but top-k), tested on a Hopper GPU and in interpret mode. What the
kernels read from :func:`current_target` is ``smem_bytes`` (how many pipeline stages fit),
``num_sms`` (grid sizes) and ``mma``: the grouped GEMM, the prefill and decode index scoring, the
KV-block-major sparse attention and the sparse decode attention take their Blackwell paths (tcgen05
into TMEM, each package's ``blackwell`` module, picked by :func:`arch_module`) when it is ``"tcgen05"``; the query-major attention baseline issues wgmma, a Hopper-only
instruction, and does not run on sm_100 (the self-check, :mod:`m3jax.pallas.verdicts`, keeps a kernel
off a GPU where it fails). Other compute capabilities are named, not guessed: sm_120-class GPUs
(``SM120``: no wgmma or tcgen05, 99 KiB of SMEM) and unknown ones get a ``Target`` with a
``refused`` reason, and no kernel is built for them (the model takes the reference path). What the
rest of the port would change (2-CTA MMA, TMA gather) is docs/KERNELS.md §5's. :func:`lowering_for` and
:func:`interpret_as` build the kernels for another target on a CPU (lowering tests, interpret tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for kernels)
from jax.experimental.mosaic.gpu import fragmented_array
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir.dialects import nvvm


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    mma: str  # "wgmma" (Hopper, register accumulators) | "tcgen05" (Blackwell, TMEM accumulators)
    smem_bytes: int
    num_sms: int
    refused: str | None = None  # why no kernel runs on this target (the model takes the reference path)


HOPPER = Target("sm_90a", mma="wgmma", smem_bytes=232_448, num_sms=132)
BLACKWELL = Target("sm_100a", mma="tcgen05", smem_bytes=232_448, num_sms=148)
# Consumer Blackwell (RTX 50xx, RTX PRO 6000 Blackwell): neither wgmma nor tcgen05, 99 KiB of SMEM per block.
SM120 = Target("sm_120a", mma="none", smem_bytes=101_376, num_sms=1,  # num_sms: nothing is launched
               refused="sm_120-class GPUs have neither wgmma nor tcgen05, which every MMA kernel here issues")
# Compute capabilities the kernels are built for: Hopper, and the datacenter Blackwells (sm_103 runs
# sm_100a code). Anything else is refused by name rather than guessed from its major version.
_TARGETS = {(9, 0): HOPPER, (10, 0): BLACKWELL, (10, 3): BLACKWELL, (12, 0): SM120, (12, 1): SM120}


def target_of(compute_capability: str) -> Target:
    """The target of a compute capability ("10.0"); one the kernels do not know is refused by name."""
    try:
        major, minor = (int(x) for x in compute_capability.split("."))
    except ValueError:
        major = minor = None
    if (major, minor) in _TARGETS:
        return _TARGETS[(major, minor)]
    return Target(f"sm_{compute_capability.replace('.', '')}", mma="none", smem_bytes=0, num_sms=1,
                  refused=f"compute capability {compute_capability} is not a target the kernels are built for "
                          "(sm_90a, sm_100a/sm_103a)")


def arch_module(hopper, blackwell, mma: str | None = None):
    """The per-architecture module of a kernel package: its ``blackwell`` module (tcgen05 into TMEM) when
    ``mma`` (default: :func:`current_target`'s) is ``"tcgen05"``, else its ``hopper`` module (wgmma).
    Every kernel package picks its tile maths here and nowhere else (docs/KERNELS.md, "Per-architecture
    kernels")."""
    return blackwell if (mma or current_target().mma) == "tcgen05" else hopper


# Set by lowering_for / interpret_as: the target the kernels are built for, and whether they lower
# for it as on that GPU (True) or run in interpret mode (False), whatever the machine.
_target_override: Target | None = None
_on_gpu_override: bool | None = None


def on_gpu() -> bool:
    return _on_gpu_override if _on_gpu_override is not None else jax.default_backend() == "gpu"


def current_target() -> Target:
    """The target of the default GPU (Hopper off-GPU: interpret mode simulates Hopper semantics)."""
    if _target_override is not None:
        return _target_override
    if on_gpu():
        return target_of(str(getattr(jax.devices()[0], "compute_capability", "?")))
    return HOPPER


@contextlib.contextmanager
def _override(target: Target, lowering: bool):
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    global _target_override, _on_gpu_override
    arch = {"sm_90a": (9, 0), "sm_100a": (10, 0)}[target.name]
    saved = mgpu_utils._infer_arch, _target_override, _on_gpu_override
    # Jitted wrappers keep traces made for another target (interpret mode, its SM count, its MMA):
    # traced again inside, and the ones made inside are not kept.
    jax.clear_caches()
    mgpu_utils._infer_arch, _target_override, _on_gpu_override = (lambda: arch), target, lowering
    try:
        yield
    finally:
        mgpu_utils._infer_arch, _target_override, _on_gpu_override = saved
        jax.clear_caches()


def lowering_for(target: Target):
    """Trace and lower the kernels as on a ``target`` GPU, on any machine (CPU lowering tests).

    Nothing in jax 0.11.2 selects the arch Mosaic GPU lowers for (no option, no env var): it reads the
    default device's compute capability in ``jax.experimental.mosaic.gpu.utils._infer_arch``, (9, 0)
    when there is no GPU. So while this is active that private function answers ``target``'s arch,
    and ``on_gpu`` / ``current_target`` answer as on that GPU (no interpret mode; its SMEM and SMs).
    """
    return _override(target, lowering=True)


def interpret_as(target: Target):
    """Run the kernels in interpret mode (also on a GPU) as built for ``target``: its MMA path (the
    Blackwell variants' tests; interpret mode models tcgen05 and TMEM), its SMEM and SMs."""
    return _override(target, lowering=False)


def tcgen05_thread_sync(wait: str) -> None:
    """Hand TMEM from this warpgroup's threads to the tensor core (kernel body, not interpret mode):
    ``tcgen05.wait::{wait}`` (this thread's TMEM loads, "ld", or stores, "st", are done),
    ``tcgen05.fence::before_thread_sync``, the warpgroup's ``bar.sync``, then
    ``tcgen05.fence::after_thread_sync``. The PTX ISA orders tcgen05 operations of different threads
    only through a synchronisation bracketed by these two fences; Pallas' ``wait_load_tmem`` /
    ``commit_tmem`` emit the wait and the ``bar.sync`` without them. Lowered through ``inline_mgpu``
    (Pallas exposes the fences only inside its barriers with ``orders_tensor_core``)."""
    if wait not in ("ld", "st"):
        raise ValueError(f"tcgen05_thread_sync: wait must be 'ld' or 'st', got {wait!r}")

    @plgpu.inline_mgpu()
    def tcgen05_thread_sync(_ctx):
        mgpu_utils.inline_ptx(f"tcgen05.wait::{wait}.sync.aligned;", has_side_effects=True)
        nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)
        mgpu_utils.warpgroup_barrier()
        nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC)

    tcgen05_thread_sync()


def tiled_layout(tiles, *, warp_dims, lane_dims, vector_dim=-1):
    """A register layout of Mosaic GPU's general tiled family (``plgpu.Layout.TILED``), for loads and
    stores whose thread-to-element map no named layout gives."""
    return plgpu.Layout.TILED(fragmented_array.Tiling(tuple(tiles)), warp_dims=tuple(warp_dims),
                              lane_dims=tuple(lane_dims), vector_dim=vector_dim)


def interpret_params(detect_races: bool = True):
    """GPU interpret mode for CPU tests: simulated SMEM, barriers, TMA and a race detector."""
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def interprets(interpret: bool | None) -> bool:
    """Whether :func:`mosaic_kernel` given ``interpret`` runs the kernel in interpret mode (None: off-GPU)."""
    return not on_gpu() if interpret is None else interpret


def mosaic_kernel(body, *, interpret: bool | None = None, detect_races: bool = True, **kwargs):
    """``plgpu.kernel`` that runs in GPU interpret mode when no GPU is present (or when asked).

    ``kwargs`` are ``plgpu.kernel``'s: out_type, scratch_types, grid, grid_names, num_threads,
    thread_name, cluster, compiler_params.
    """
    interpret = interprets(interpret)
    if not interpret:
        refused = current_target().refused
        if refused:
            raise NotImplementedError(f"Mosaic GPU kernel on {current_target().name}: {refused}")
        return plgpu.kernel(body, **kwargs)
    kernel = plgpu.kernel(body, interpret=interpret_params(detect_races), **kwargs)

    # The interpreter runs the kernel body as XLA ops on the default device. On a GPU (the Blackwell
    # variants interpreted on a Hopper GPU) an fp32 dot would run as TF32, so the body is traced under
    # "highest"; and XLA may drop an f32 -> bf16 -> f32 round trip, so in-kernel splits ask
    # `interpreting()` and round on the bits instead (_common.bf16_split_in_kernel).
    @functools.wraps(kernel)
    def exact(*args, **kw):
        global _interpreting
        _interpreting += 1
        try:
            with jax.default_matmul_precision("highest"):
                return kernel(*args, **kw)
        finally:
            _interpreting -= 1

    return exact


_interpreting = 0  # > 0 while an interpret-mode kernel body is traced


def interpreting() -> bool:
    """Whether the kernel body being traced runs in interpret mode (as XLA ops, not Mosaic GPU)."""
    return _interpreting > 0


def interpret_races_found() -> bool:
    """Whether the interpret-mode race detector has reported a race since the last reset."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    races = getattr(gpu_callbacks, "_races", None)  # None until the first interpreted kernel
    return bool(races is not None and races.races_found)


def reset_interpret_state() -> None:
    """Clear interpret-mode state (races, simulated memory); needed after a kernel raised."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.reset_gpu_interpret_mode_state()
