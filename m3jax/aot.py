"""Ahead-of-time program cache: a second run skips tracing and Mosaic GPU lowering, not only XLA.

JAX's persistent compilation cache is looked up with the lowered module, so a run that hits it has
already traced the model and lowered every Mosaic GPU kernel, which at M3 widths is most of a second
``generate``'s compile (``benchmarks/RESULTS.md#generate-second-process``). Mosaic GPU also names each kernel module after a per-process
counter (``mosaic_gpu.dump_basename = "body_<n>"``), so a program lowered after a different number of
kernels (a self-check canary ran first, or an earlier program in the same process) has other bytes and
misses that cache altogether.

:func:`compile` exports a program once with :mod:`jax.export` (StableHLO, the Mosaic GPU kernels inside
as their ``mosaic_gpu_v2`` custom calls) and stores it in the cache directory; a later process with
the same key reads it back and compiles ``Exported.call``, which finds the executable in JAX's
persistent cache (the first run compiled the same deserialised module). The file is our own format,
a JSON header (the key, the flat input / output avals, the export's calling-convention fields) and
the serialised module after it, because ``Exported.serialize`` needs the ``flatbuffers`` package,
which the GPU image lacks; nothing is pickled. The key holds the program's name and static
arguments (with the code digests of the MSA selection rules a config names, which live outside the
m3jax sources), its inputs' shapes, dtypes and shardings, the m3jax sources, the jax / jaxlib versions,
the devices and the kernels' target, so an entry is only ever read by the code that wrote it.

Programs are exported over their flat input leaves and return flat leaves; the caller declares the
output pytree (``out_tree``), so a hit needs no trace at all. Programs over several devices (the
engine under a mesh) are exported with their inputs' shardings: the header keeps each one's abstract
mesh (axis names, sizes and types, device kind) and partition spec, and the program is read back onto
whichever devices its arguments sit on (the key holds their shardings: mesh shape and specs, not which
devices). Programs
with effects or with custom calls outside :data:`SAFE_CUSTOM_CALLS` are compiled directly, with one
warning: interpret-mode kernels call back into Python, and cuDNN attention on several devices goes
through ``custom_partitioning``, whose call holds a Python pointer. A bad entry (torn write, other
format, another key) is reported with a warning and rebuilt.

:func:`compile_all` builds several programs at once (the engine's warmup: a prefill program per key
window and the decode program). Staging a program (trace, export, lower) holds the GIL, and at M3
widths it is mostly Mosaic GPU lowering its kernels in Python, so the programs to export are staged
in forked child processes as well as the calling one (each child writes its export to a file and
exits; the calling thread keeps the mesh of ``jax.set_mesh`` and every other setting, which the fork
copies). XLA's compiles of the lowered modules run side by side on worker threads, which release the
GIL: each starts as soon as its program is lowered.

Compiled programs are also kept in memory for the process (a second engine reuses them);
:func:`clear` drops those (a benchmark's "second run" in one process). Nothing is evicted from the
folder: entries of older sources are never read again, and the folder can be deleted at any time.

A hit does not trace the model, so the kernels' self-check (:mod:`m3jax.pallas.verdicts`, consulted while
tracing) is not asked again: the stored program is the one built when the checks had passed for the
same sources, JAX version and device kind, which their verdicts are keyed on too (with the driver).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax import export

from m3jax.atomic import atomic_write
from m3jax.config import M3Config, TextConfig
from m3jax.envvars import env_count
from m3jax.msa import layer as msa_layer
from m3jax.pallas import _backend

FORMAT = 2  # 2: shardings and the device count in the header
# Custom calls besides jax.export's stable set (which has the Mosaic GPU kernels' mosaic_gpu_v2) that
# may be stored: cuDNN's forward flash attention as one device runs it (everything in its backend
# config). Under a mesh XLA partitions it through custom_partitioning, which export refuses.
SAFE_CUSTOM_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaSoftmaxDropout",
                     "__cudnn$fmhaScaleBiasSoftmaxDropout", "__cudnn$fmhaSoftmaxF8")

_dir: Path | None = None
_stats: dict | None = None
_memo: dict[str, Callable] = {}
_warned: set[str] = set()


@contextlib.contextmanager
def disk_cache(path: Path | None):
    """Store and read exported programs in ``path`` while the block runs (None: memory only). Yields
    {"dir", "hits", "misses", "uncached"}: programs read from disk, exported and written, and compiled
    without the cache (export refused); programs already in memory count nowhere."""
    global _dir, _stats
    stats = {"dir": None if path is None else str(path), "hits": 0, "misses": 0, "uncached": 0}
    saved = _dir, _stats
    _dir, _stats = path, stats
    try:
        yield stats
    finally:
        _dir, _stats = saved


def clear() -> None:
    """Forget the programs compiled in this process (the disk cache stays)."""
    _memo.clear()


def _count(what: str) -> None:
    if _stats is not None:
        _stats[what] += 1


def _warn(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(f"m3jax.aot: {msg}", RuntimeWarning, stacklevel=3)


@functools.cache
def source_hash() -> str:
    """SHA-256 over every m3jax source file (path and bytes): any code change is a new key."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _environment() -> dict:
    """What else decides the lowered program: versions, devices, the kernels' target, JAX flags."""
    import jaxlib

    dev = jax.devices()[0]
    return {"format": FORMAT, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform": dev.client.platform_version, "device_kind": dev.device_kind,
            "kernel_target": _backend.current_target().name, "kernels_on_gpu": _backend.on_gpu(),
            "x64": bool(jax.config.jax_enable_x64), "precision": str(jax.config.jax_default_matmul_precision),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "m3jax": source_hash()}


def program_key(name: str, leaves: list, in_tree, static: dict, out_shardings: tuple | None = None) -> str:
    """Hex key of program ``name`` for these input leaves (shape, dtype, sharding), input tree, static
    arguments (their reprs: configs are frozen dataclasses, and the code digests of the MSA selection
    rules a config names) and pinned output shardings (flat), in this environment."""
    desc = {"name": name, "in_tree": str(in_tree), "static": {k: repr(v) for k, v in sorted(static.items())},
            # a config names its MSA selection rules; their code is the registering process's, not m3jax's
            "selection_rules": {k: msa_layer.rule_digests(v.text if isinstance(v, M3Config) else v)
                                for k, v in sorted(static.items()) if isinstance(v, (M3Config, TextConfig))},
            "inputs": [[list(x.shape), str(x.dtype), str(getattr(x, "sharding", None))] for x in leaves],
            **_environment()}
    if out_shardings is not None:
        desc["out_shardings"] = [str(x) for x in out_shardings]
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _aval_json(a) -> list:
    return [list(a.shape), np.dtype(a.dtype).name]


def _sharding_json(s) -> dict | None:
    """An export's NamedSharding over an abstract mesh as JSON (None: unspecified)."""
    if s is None:
        return None
    mesh, dev = s.mesh, s.mesh.abstract_device
    return {"axis_sizes": list(mesh.axis_sizes), "axis_names": list(mesh.axis_names),
            "axis_types": [t.name for t in mesh.axis_types],
            "device": None if dev is None else [dev.device_kind, dev.num_cores, dev.platform],
            "spec": [None if p is None else [p] if isinstance(p, str) else list(p) for p in s.spec],
            "reduced": sorted(s.spec.reduced), "unreduced": sorted(s.spec.unreduced), "memory_kind": s.memory_kind}


def _sharding_from_json(h: dict | None):
    if h is None:
        return None
    from jax._src import mesh as mesh_lib

    dev = None if h["device"] is None else mesh_lib.AbstractDevice(*h["device"])
    mesh = mesh_lib.AbstractMesh(tuple(h["axis_sizes"]), tuple(h["axis_names"]),
                                 tuple(jax.sharding.AxisType[t] for t in h["axis_types"]), abstract_device=dev)
    spec = jax.sharding.PartitionSpec(*[None if p is None else p[0] if len(p) == 1 else tuple(p) for p in h["spec"]],
                                      reduced=frozenset(h["reduced"]), unreduced=frozenset(h["unreduced"]))
    return jax.sharding.NamedSharding(mesh, spec, memory_kind=h["memory_kind"])


def _encode(key: str, exp: export.Exported) -> bytes:
    header = {"format": FORMAT, "key": key, "fun_name": exp.fun_name,
              "in_avals": [_aval_json(a) for a in exp.in_avals], "out_avals": [_aval_json(a) for a in exp.out_avals],
              "in_shardings": [_sharding_json(x) for x in exp._in_named_shardings],
              "out_shardings": [_sharding_json(x) for x in exp._out_named_shardings], "nr_devices": exp.nr_devices,
              "platforms": list(exp.platforms), "calling_convention_version": exp.calling_convention_version,
              "module_kept_var_idx": list(exp.module_kept_var_idx), "uses_global_constants": exp.uses_global_constants,
              "disabled_custom_calls": [c.is_custom_call() for c in exp.disabled_safety_checks],
              "module_sha256": hashlib.sha256(exp.mlir_module_serialized).hexdigest()}
    return json.dumps(header).encode() + b"\n" + bytes(exp.mlir_module_serialized)


def _decode(data: bytes, key: str) -> export.Exported:
    """The Exported stored in ``data`` (written by :func:`_encode` under ``key``); ValueError if it is not."""
    head, sep, module = data.partition(b"\n")
    if not sep:
        raise ValueError("no header")
    h = json.loads(head)
    if h.get("format") != FORMAT:
        raise ValueError(f"format {h.get('format')!r}, expected {FORMAT}")
    if h["key"] != key:
        raise ValueError("written for another program (key mismatch)")
    if hashlib.sha256(module).hexdigest() != h["module_sha256"]:
        raise ValueError("module bytes do not match their checksum (torn or altered file)")
    from jax._src import core

    def avals(entries, shardings):  # an aval carries its sharding, as export's own reader builds them
        out = []
        for (shape, dtype), sharding in zip(entries, shardings, strict=True):
            a = core.ShapedArray(tuple(shape), np.dtype(dtype))
            out.append(a if sharding is None else core.update_aval_with_sharding(a, sharding))
        return tuple(out)

    in_sh = tuple(_sharding_from_json(x) for x in h["in_shardings"])
    out_sh = tuple(_sharding_from_json(x) for x in h["out_shardings"])
    in_avals, out_avals = avals(h["in_avals"], in_sh), avals(h["out_avals"], out_sh)
    n_in, n_out = len(in_avals), len(out_avals)
    return export.Exported(
        fun_name=h["fun_name"], in_tree=jax.tree.structure(((0,) * n_in, {})), in_avals=in_avals,
        out_tree=jax.tree.structure((0,) * n_out), out_avals=out_avals,
        _in_named_shardings=in_sh, _out_named_shardings=out_sh,
        in_shardings_hlo=(None,) * n_in, out_shardings_hlo=(None,) * n_out,
        nr_devices=h["nr_devices"], platforms=tuple(h["platforms"]), ordered_effects=(), unordered_effects=(),
        disabled_safety_checks=tuple(export.DisabledSafetyCheck.custom_call(c) for c in h["disabled_custom_calls"]),
        mlir_module_serialized=module, calling_convention_version=h["calling_convention_version"],
        module_kept_var_idx=tuple(h["module_kept_var_idx"]), uses_global_constants=h["uses_global_constants"],
        _get_vjp=None)


class OutTreeError(ValueError):
    """A program's outputs are not the pytree its caller declared (a bug in the caller, not a cache miss)."""


def _mesh_sharding(x):
    """``x``'s sharding where it spans several devices (what the export records), else None."""
    sharding = getattr(x, "sharding", None)
    return sharding if sharding is not None and len(sharding.device_set) > 1 else None


def _export(fn: Callable, leaves: list, in_tree, out_tree, static: dict, name: str,
            out_shardings: tuple | None = None) -> export.Exported:
    def flat(*xs):
        out = fn(*jax.tree.unflatten(in_tree, xs), **static)
        out_leaves, tree = jax.tree.flatten(out)
        if tree != out_tree:
            raise OutTreeError(f"{name} returned {tree}, declared {out_tree}")
        return tuple(out_leaves)

    flat.__name__ = name
    checks = [export.DisabledSafetyCheck.custom_call(c) for c in SAFE_CUSTOM_CALLS]
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_mesh_sharding(x)) for x in leaves]
    # The kernels' launcher decides the platform (tests lower the GPU kernels on a CPU host).
    platform = "cuda" if _backend.on_gpu() else export.default_export_platform()
    exp = export.export(jax.jit(flat, out_shardings=out_shardings), platforms=(platform,), disabled_checks=checks)(*specs)
    if exp.ordered_effects or exp.unordered_effects:
        raise ValueError("the program has effects")
    return exp


def _lower_exported(exp: export.Exported, leaves: list, donate_argnums: tuple[int, ...]):
    return jax.jit(exp.call, donate_argnums=donate_argnums).lower(*leaves)


def _read(path: Path, key: str) -> export.Exported | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(f"cannot read {path} ({e}); compiling instead")
        return None
    try:
        return _decode(data, key)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        _warn(f"ignoring the cache entry {path}: {e}; it is rebuilt")
        return None


def _write(path: Path, data: bytes) -> None:
    """Atomically (a reader sees the old file or the whole new one); a failure only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
    except OSError as e:
        _warn(f"cannot write {path} ({e}); programs are not cached")


def _cpu_count_up_to_8() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def compile_threads() -> int:
    """Worker threads that :func:`compile_all` gives XLA: ``$M3JAX_COMPILE_THREADS``, default the CPU
    count up to 8 (1: one after the other)."""
    return env_count("M3JAX_COMPILE_THREADS", _cpu_count_up_to_8())


def stage_processes() -> int:
    """Processes that :func:`compile_all` exports programs in: ``$M3JAX_STAGE_PROCESSES``, default the
    CPU count up to 8 (1: every program in this process)."""
    return env_count("M3JAX_STAGE_PROCESSES", _cpu_count_up_to_8())


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: the arguments of :func:`compile`."""

    name: str
    fn: Callable
    args: tuple
    out_tree: Any
    static: dict | None = None
    donate_argnums: tuple[int, ...] = ()
    out_shardings: Any = None


@dataclasses.dataclass
class _Staged:
    """A program on its way to XLA: its flat inputs and cache key (:func:`_locate`), then traced and
    lowered (:func:`_stage`): ``lowered`` is the exported module read back (``source`` "hit") or just
    exported (``source`` "miss", ``data`` to be written once it compiles); None where the program is
    in memory (``run``) or compiles the plain way."""

    program: Program
    key: str
    leaves: list
    in_tree: Any
    donated: tuple[int, ...]
    flat_out: tuple | None
    run: Callable | None = None
    lowered: Any = None
    source: str = ""
    path: Path | None = None
    data: bytes | None = None
    compiled: Any = None
    error: Exception | None = None


def _brief(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _warn_rebuilt(path: Path, e: Exception) -> None:
    _warn(f"the cache entry {path} did not compile ({_brief(e)}); it is rebuilt")


def _warn_uncompiled(name: str, e: Exception) -> None:
    _warn(f"{name} was exported but its module did not compile ({_brief(e)}); it is compiled without the AOT cache")


def _locate(p: Program) -> _Staged:
    """``p``'s flat inputs, key, compiled call if this process has it, and file in the disk cache."""
    leaves, in_tree = jax.tree.flatten(p.args)
    flat_out = None if p.out_shardings is None else tuple(p.out_tree.flatten_up_to(p.out_shardings))
    key = program_key(p.name, leaves, in_tree, p.static or {}, flat_out)
    # Leaf indices of the donated arguments: the exported program takes the leaves flat.
    bounds = np.cumsum([0] + [len(jax.tree.leaves(a)) for a in p.args])
    donated = tuple(i for a in p.donate_argnums for i in range(bounds[a], bounds[a + 1]))
    st = _Staged(p, key, leaves, in_tree, donated, flat_out, run=_memo.get(key))
    if st.run is None and _dir is not None:
        st.path = Path(_dir) / f"{p.name}-{key[:32]}.m3aot"
    return st


def _exported(st: _Staged) -> bytes:
    """The program traced and exported, as the disk cache stores it."""
    p = st.program
    return _encode(st.key, _export(p.fn, st.leaves, st.in_tree, p.out_tree, p.static or {}, p.name, st.flat_out))


def _stage(st: _Staged, read: bool = True, data: bytes | None = None) -> _Staged:
    """Lower ``st``'s program (nothing where it is in memory or there is no disk cache): read back from
    the disk cache, else from ``data`` (its export, made in a staging process), else exported here."""
    if st.run is not None or st.path is None:
        return st
    exp = _read(st.path, st.key) if read else None
    if exp is not None:
        try:
            st.lowered, st.source = _lower_exported(exp, st.leaves, st.donated), "hit"
        except Exception as e:  # noqa: BLE001  (a parseable entry that does not lower: rebuild it)
            _warn_rebuilt(st.path, e)
    if st.lowered is None and data is None:
        try:
            data = _exported(st)
        except OutTreeError:
            raise
        except Exception as e:  # noqa: BLE001  (export refused: custom call, effects; compile the plain way)
            _warn(f"{st.program.name} cannot be exported ({_brief(e)}); it is compiled without the AOT cache")
    if st.lowered is None and data is not None:
        st.data = data
        try:
            # Compile the module as a later run will read it back, so that run hits JAX's cache.
            st.lowered, st.source = _lower_exported(_decode(data, st.key), st.leaves, st.donated), "miss"
        except Exception as e:  # noqa: BLE001  (never fail the run for the cache: compile the plain way)
            _warn_uncompiled(st.program.name, e)
    return st


def _xla_compile(st: _Staged) -> None:
    """The part that runs on a worker thread: XLA's compile of the lowered module (no tracing, no
    context the caller's thread holds); an error is kept for :func:`_finish`."""
    try:
        st.compiled = st.lowered.compile()
    except Exception as e:  # noqa: BLE001  (reported and handled on the caller's thread)
        st.error = e


def _finish(st: _Staged) -> Callable:
    p = st.program
    if st.run is not None:
        return st.run
    if st.lowered is not None and st.compiled is None:
        if st.source == "hit":  # a parseable entry XLA refuses: rebuild it, never fail the run
            _warn_rebuilt(st.path, st.error)
            st = _stage(_locate(p), read=False)
            if st.lowered is not None:
                _xla_compile(st)
            return _finish(st)
        _warn_uncompiled(p.name, st.error)
        st.lowered = None
    if st.compiled is None:  # not exportable (or no disk cache): jit as usual
        compiled = jax.jit(functools.partial(p.fn, **(p.static or {})), donate_argnums=p.donate_argnums,
                           out_shardings=p.out_shardings).lower(*p.args).compile()
        if _dir is not None:
            _count("uncached")
        run = compiled
    else:
        if st.source == "hit":
            _count("hits")
        else:
            _write(st.path, st.data)
            _count("misses")

        def run(*call_args, _compiled=st.compiled, _out_tree=p.out_tree):
            return jax.tree.unflatten(_out_tree, _compiled(*jax.tree.leaves(call_args)))

    _memo[st.key] = run
    return run


# A staging process that has not exported its program by then is killed, and the program is exported in
# the calling process: a trace that waits on something the fork did not carry over must not hang the run.
STAGE_DEADLINE_S = 300.0


def _fork_export(st: _Staged, out: Path) -> int:
    """Export ``st``'s program in a child process (``os.fork``: the child holds this process's state as
    it is, so it traces the very program this process would) into ``out``; returns the child's pid.
    The child only traces and lowers, never runs anything on a device, and leaves by ``os._exit``."""
    with warnings.catch_warnings():
        # JAX and Python warn that a fork of a threaded process may deadlock in the child, which holds
        # a copy of any lock another thread held. The child takes no runtime lock (it does not execute
        # or compile), and one that hangs anyway is killed at STAGE_DEADLINE_S and its program staged here.
        warnings.simplefilter("ignore")
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _own_mlir_threads()
        # Nothing the child says reaches the parent's outputs: the parent repeats a failed export, with its
        # warnings, in its own. Python's streams and logging go too, since in a notebook they are the
        # kernel's message channel, not file descriptors 1 and 2.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (the child ends by os._exit)
        logging.disable(logging.CRITICAL)
        atomic_write(out, _exported(st))
        code = 0
    except BaseException as e:  # noqa: BLE001  (told to the parent, which stages the program itself)
        with contextlib.suppress(OSError):
            frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
            where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
            out.with_suffix(".err").write_text(_brief(e) + where)
    finally:
        os._exit(code)  # no atexit handlers, no runtime teardown: they are the parent's


_inherited: list = []  # a forked child's copies of the parent's MLIR thread pool and context


def _own_mlir_threads() -> None:
    """Give a forked child its own MLIR thread pool. JAX's MLIR contexts share one pool, whose threads
    are the parent's and do not exist in the child: the first parallel pass (the module's verifier)
    would wait on them forever. The context JAX keeps per thread goes too, since it holds that pool."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    # The old pool and context stay referenced: destroying the pool joins threads the child does not have.
    _inherited.append((mlir.global_thread_pool, mlir._thread_local_context.value))
    mlir.global_thread_pool = ir.ThreadPool()
    mlir._thread_local_context.set_local(None)


def _forked(children: dict[int, tuple[_Staged, Path]]):
    """Yield (staged, export bytes, None) as each staging child ends, or (staged, None, why) where it
    failed or passed :data:`STAGE_DEADLINE_S` (killed)."""
    t0 = time.monotonic()
    while children:
        ended = False
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() - t0 < STAGE_DEADLINE_S:
                continue
            st, out = children.pop(pid)
            ended = True
            if not done:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                why = f"took over {STAGE_DEADLINE_S:.0f} s"
            elif os.waitstatus_to_exitcode(status) == 0:
                yield st, out.read_bytes(), None
                continue
            else:
                err = out.with_suffix(".err")
                code = os.waitstatus_to_exitcode(status)
                why = f"failed ({err.read_text() if err.exists() else f'exit status {code}'})"
            yield st, None, why
        if not ended:
            time.sleep(0.02)


def compile_all(programs: list[Program], threads: int | None = None, timing: dict | None = None,
                processes: int | None = None, confirm: Callable[[], None] | None = None) -> list[Callable]:
    """:func:`compile` for several programs, staged in several processes and compiled by XLA side by
    side. Staging (trace, export, lower) holds the GIL, and at M3 widths it is mostly Mosaic GPU's
    lowering of the kernels, in Python: so the programs to export are exported in up to ``processes``
    processes (default :func:`stage_processes`; only with a disk cache, in a one-process job): this one
    and forked children, each child handing its export back through a file while this process stages
    the others (programs read back from the disk, or past the count). The first program to export is
    staged here before any fork, so that what a trace computes once per process (the kernels'
    self-check verdicts) is computed once and inherited. Each lowered program goes as soon as it is
    ready to one of up to ``threads`` worker threads (default :func:`compile_threads`) for XLA's
    compile, which releases the GIL. Then each is written to the disk cache and kept in memory, in
    order. Returns the programs' calls in the order given; a program listed twice is compiled once.
    ``timing`` (a dict) gets the seconds of the phases: ``stage_s`` (staging every program, XLA
    compiling beside it), ``xla_s`` (the compiles still running after that), ``confirm_s`` (waiting in
    ``confirm``) and ``finish_s`` (written to disk; programs that cannot be exported are compiled here),
    and ``forked``, the programs a child process exported. ``confirm()`` is called once XLA's compiles
    end, before anything is written to the disk cache or kept: a first run traces while its kernels'
    self-check still runs, presuming they pass (:class:`m3jax.pallas.verdicts.Background`), and what
    ``confirm`` raises when one did not leaves no program behind."""
    t0 = time.perf_counter()
    staged: dict[str, _Staged] = {}
    order = []
    for p in programs:
        st = _locate(p)
        order.append(st.key)
        staged.setdefault(st.key, st)
    # Multi-process jobs stage in-process: a fork would copy the distributed client's connections.
    to_export = [st for st in staged.values() if st.path is not None and not st.path.exists()]
    forks = (min(len(to_export), processes or stage_processes()) - 1
             if hasattr(os, "fork") and jax.process_count() == 1 else 0)
    children: dict[int, tuple[_Staged, Path]] = {}
    with contextlib.ExitStack() as stack:
        if forks > 0:
            _stage(to_export[0])
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="m3jax-stage-")))
            stack.callback(_reap, children)  # an error here leaves no child behind
            for i, st in enumerate(to_export[1:forks + 1]):
                children[_fork_export(st, tmp / f"{i}.m3aot")] = st, tmp / f"{i}.m3aot"
        # The pool's threads start after the forks: no child holds a copy of a compiling thread's locks.
        workers = min(len(staged), threads or compile_threads())
        pool = (stack.enter_context(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="m3jax-compile"))
                if workers > 1 else None)
        compiling = []

        def submit(st: _Staged) -> None:
            if st.run is None and st.lowered is not None:
                if pool is None:
                    _xla_compile(st)
                else:
                    compiling.append(pool.submit(_xla_compile, st))

        in_children = {id(st) for st, _ in children.values()}
        for st in staged.values():
            if id(st) not in in_children:
                submit(st if forks > 0 and st is to_export[0] else _stage(st))
        forked = 0
        for st, data, why in _forked(children):
            forked += data is not None
            _stage(st, read=False, data=data)
            if why and st.source == "miss":
                # Exported here but not in the child: the fork is what failed (export refusals, which fail
                # here as well, have their own warning), and the staging lost its parallelism.
                _warn(f"staging {st.program.name} in a child process {why}; it was staged in this process")
            submit(st)
        t1 = time.perf_counter()
        for f in compiling:
            f.result()
    t2 = time.perf_counter()
    if confirm is not None:
        confirm()
    t3 = time.perf_counter()
    runs = {key: _finish(st) for key, st in staged.items()}
    if timing is not None:
        timing.update(stage_s=t1 - t0, xla_s=t2 - t1, confirm_s=t3 - t2, finish_s=time.perf_counter() - t3,
                      forked=forked)
    return [runs[key] for key in order]


def _reap(children: dict[int, tuple[_Staged, Path]]) -> None:
    """Kill and wait for the staging children still running (compile_all is leaving on an error)."""
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    children.clear()


def compile(name: str, fn: Callable, args: tuple, *, out_tree, static: dict | None = None,
            donate_argnums: tuple[int, ...] = (), out_shardings=None) -> Callable[..., Any]:
    """``fn(*args, **static)`` compiled for the shapes, dtypes and shardings of ``args``: returns
    ``call(*args) -> outputs`` (a pytree of structure ``out_tree``), taking arguments structured as
    ``args``. ``donate_argnums`` index ``args`` (each argument's leaves are donated). Through the disk
    cache of :func:`disk_cache` where the program can be exported (no effects, no unsafe custom call), else
    ``jax.jit(fn).lower(...).compile()``; either way kept in memory for the process.

    ``out_shardings`` (a pytree of shardings of structure ``out_tree``, or None: XLA chooses) pins the
    outputs' placement. A program whose outputs come back as its next call's inputs needs it under a
    mesh: the compiled call takes inputs only as lowered, and XLA may place the outputs of the exported
    module otherwise than those of the traced function."""
    return compile_all([Program(name, fn, args, out_tree, static, donate_argnums, out_shardings)])[0]
