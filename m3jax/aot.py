"""Ahead-of-time program cache: a second run skips tracing and Mosaic GPU lowering, not only XLA.

JAX's persistent compilation cache is looked up with the lowered module, so a run that hits it has
already traced the model and lowered every Mosaic GPU kernel (measured on the H200 at M3 widths: 45 s of
a second ``generate``'s compile). Mosaic GPU also names each kernel module after a per-process
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
arguments, its inputs' shapes, dtypes and shardings, the m3jax sources, the jax / jaxlib versions,
the devices and the kernels' target, so an entry is only ever read by the code that wrote it.

Programs are exported over their flat input leaves and return flat leaves; the caller declares the
output pytree (``out_tree``), so a hit needs no trace at all. Programs over several devices (the
engine under a mesh) are compiled directly, not cached: an export would carry abstract-mesh
shardings that this format does not store. Neither are programs with effects or with custom calls
outside :data:`SAFE_CUSTOM_CALLS` (interpret-mode kernels call back into Python). A bad entry (torn
write, other format, another key) is reported with a warning and rebuilt.

Compiled programs are also kept in memory for the process (a second engine reuses them);
:func:`clear` drops those (a benchmark's "second run" in one process). Nothing is evicted from the
folder: entries of older sources are never read again, and the folder can be deleted at any time.

A hit does not trace the model, so the kernels' self-check (:mod:`m3jax.selfcheck`, consulted while
tracing) is not asked again: the stored program is the one built when the checks had passed for the
same sources, JAX version and device kind, which is what their verdicts are keyed on too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax import export

FORMAT = 1
# Custom calls besides jax.export's stable set (which has the Mosaic GPU kernels' mosaic_gpu_v2) that
# may be stored: cuDNN's forward flash attention (single device: everything in its backend config).
# Under a mesh it goes through custom_partitioning, whose call holds a Python pointer; meshes are not
# cached.
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
    without the cache (several devices, or export refused); programs already in memory count nowhere."""
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

    from m3jax.pallas import _backend

    dev = jax.devices()[0]
    return {"format": FORMAT, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform": dev.client.platform_version, "device_kind": dev.device_kind,
            "kernel_target": _backend.current_target().name, "kernels_on_gpu": _backend.on_gpu(),
            "x64": bool(jax.config.jax_enable_x64), "precision": str(jax.config.jax_default_matmul_precision),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "m3jax": source_hash()}


def program_key(name: str, leaves: list, in_tree, static: dict) -> str:
    """Hex key of program ``name`` for these input leaves (shape, dtype, sharding), input tree and
    static arguments (their reprs: configs are frozen dataclasses), in this environment."""
    desc = {"name": name, "in_tree": str(in_tree), "static": {k: repr(v) for k, v in sorted(static.items())},
            "inputs": [[list(x.shape), str(x.dtype), str(getattr(x, "sharding", None))] for x in leaves],
            **_environment()}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _single_device(leaves: list) -> bool:
    """Whether every leaf is on one and the same device (a leaf without a sharding: the default one)."""
    devices = set()
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            devices |= sharding.device_set
    return len(devices) <= 1


def _aval_json(a) -> list:
    return [list(a.shape), np.dtype(a.dtype).name]


def _encode(key: str, exp: export.Exported) -> bytes:
    header = {"format": FORMAT, "key": key, "fun_name": exp.fun_name,
              "in_avals": [_aval_json(a) for a in exp.in_avals], "out_avals": [_aval_json(a) for a in exp.out_avals],
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
    aval = lambda s: jax.core.ShapedArray(tuple(s[0]), np.dtype(s[1]))
    in_avals, out_avals = tuple(aval(a) for a in h["in_avals"]), tuple(aval(a) for a in h["out_avals"])
    n_in, n_out = len(in_avals), len(out_avals)
    return export.Exported(
        fun_name=h["fun_name"], in_tree=jax.tree.structure(((0,) * n_in, {})), in_avals=in_avals,
        out_tree=jax.tree.structure((0,) * n_out), out_avals=out_avals,
        _in_named_shardings=(None,) * n_in, _out_named_shardings=(None,) * n_out,
        in_shardings_hlo=(None,) * n_in, out_shardings_hlo=(None,) * n_out,
        nr_devices=1, platforms=tuple(h["platforms"]), ordered_effects=(), unordered_effects=(),
        disabled_safety_checks=tuple(export.DisabledSafetyCheck.custom_call(c) for c in h["disabled_custom_calls"]),
        mlir_module_serialized=module, calling_convention_version=h["calling_convention_version"],
        module_kept_var_idx=tuple(h["module_kept_var_idx"]), uses_global_constants=h["uses_global_constants"],
        _get_vjp=None)


class OutTreeError(ValueError):
    """A program's outputs are not the pytree its caller declared (a bug in the caller, not a cache miss)."""


def _export(fn: Callable, leaves: list, in_tree, out_tree, static: dict, name: str) -> export.Exported:
    def flat(*xs):
        out = fn(*jax.tree.unflatten(in_tree, xs), **static)
        out_leaves, tree = jax.tree.flatten(out)
        if tree != out_tree:
            raise OutTreeError(f"{name} returned {tree}, declared {out_tree}")
        return tuple(out_leaves)

    flat.__name__ = name
    checks = [export.DisabledSafetyCheck.custom_call(c) for c in SAFE_CUSTOM_CALLS]
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    from m3jax.pallas import _backend

    # The kernels' launcher decides the platform (tests lower the GPU kernels on a CPU host).
    platform = "cuda" if _backend.on_gpu() else export.default_export_platform()
    exp = export.export(jax.jit(flat), platforms=(platform,), disabled_checks=checks)(*specs)
    if exp.ordered_effects or exp.unordered_effects or exp.nr_devices != 1:
        raise ValueError("the program has effects or spans several devices")
    return exp


def _compile_exported(exp: export.Exported, leaves: list, donate_argnums: tuple[int, ...]) -> Callable:
    return jax.jit(exp.call, donate_argnums=donate_argnums).lower(*leaves).compile()


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
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        _warn(f"cannot write {path} ({e}); programs are not cached")


def compile(name: str, fn: Callable, args: tuple, *, out_tree, static: dict | None = None,
            donate_argnums: tuple[int, ...] = ()) -> Callable[..., Any]:
    """``fn(*args, **static)`` compiled for the shapes, dtypes and shardings of ``args``: returns
    ``call(*args) -> outputs`` (a pytree of structure ``out_tree``), taking arguments structured as
    ``args``. ``donate_argnums`` index ``args`` (each argument's leaves are donated). Through the disk
    cache of :func:`disk_cache` where the program can be exported (one device, no effects), else
    ``jax.jit(fn).lower(...).compile()``; either way kept in memory for the process."""
    static = static or {}
    leaves, in_tree = jax.tree.flatten(args)
    key = program_key(name, leaves, in_tree, static)
    run = _memo.get(key)
    if run is not None:
        return run
    # Leaf indices of the donated arguments: the exported program takes the leaves flat.
    bounds = np.cumsum([0] + [len(jax.tree.leaves(a)) for a in args])
    donated = tuple(i for a in donate_argnums for i in range(bounds[a], bounds[a + 1]))
    compiled = None
    if _dir is not None and _single_device(leaves):
        path = Path(_dir) / f"{name}-{key[:32]}.m3aot"
        exp = _read(path, key)
        if exp is not None:
            try:
                compiled = _compile_exported(exp, leaves, donated)
                _count("hits")
            except Exception as e:  # noqa: BLE001  (a parseable entry XLA refuses: rebuild it, never fail the run)
                _warn(f"the cache entry {path} did not compile ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}); it is rebuilt")
        if compiled is None:
            try:
                data = _encode(key, _export(fn, leaves, in_tree, out_tree, static, name))
            except OutTreeError:
                raise
            except Exception as e:  # noqa: BLE001  (export refused: custom call, effects; compile the plain way)
                _warn(f"{name} cannot be exported ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                      "it is compiled without the AOT cache")
            else:
                try:
                    # Compile the module as a later run will read it back, so that run hits JAX's cache.
                    compiled = _compile_exported(_decode(data, key), leaves, donated)
                except Exception as e:  # noqa: BLE001  (never fail the run for the cache: compile the plain way)
                    _warn(f"{name} was exported but its module did not compile ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}); it is compiled without the AOT cache")
                else:
                    _write(path, data)
                    _count("misses")
    if compiled is None:
        compiled = jax.jit(functools.partial(fn, **static), donate_argnums=donate_argnums).lower(*args).compile()
        if _dir is not None:
            _count("uncached")
        run = compiled
    else:
        def run(*call_args, _compiled=compiled):
            return jax.tree.unflatten(out_tree, _compiled(*jax.tree.leaves(call_args)))

    _memo[key] = run
    return run
