"""Verdicts of the self-check canaries (:mod:`m3jax.pallas.canaries`) on this GPU, and the choice the
model makes from them: a kernel whose canary fails, raises or hangs is not used.

A verdict is kept per canary (a kernel at one tile path) and per key: device name, compute
capability, driver, JAX version and a hash of the kernel's source files and of the canary cases. The
first time the model asks for a kernel on a key with no verdict (:func:`kernel_failure`, called where
the model chooses kernels: ``m3jax.msa.kernels`` and ``m3jax.moe``), its canaries run in a worker
process with a deadline (``$M3JAX_SELFCHECK_DEADLINE`` seconds each, default 180): a wrong barrier
count never returns, and it must not become the model's hang. A canary past its deadline is killed
and its verdict is "hung". A canary of a path the target does not have (``Canary.unsupported``: the
fp8 indexer's decode scoring on tcgen05) is not run: its verdict is "n/a", no fault of the GPU's. A
kernel is not used at a path whose canary fails, hangs or is "n/a", with one warning naming it and
why; the model runs the reference path instead where it would take that path (the kernel's other
paths stay in use: :func:`m3jax.pallas.canaries.paths_for`).

Verdicts are kept as JSON in ``$M3JAX_CACHE_DIR/selfcheck.json`` (default
``~/.cache/m3jax/selfcheck.json``), so a new JAX, GPU, driver or an edited kernel runs its canaries
again and nothing else does. A file that does not parse (truncated, edited) is ignored with a warning
and rewritten whole (written to a temporary file, then renamed).

Off the GPU the kernels run only in interpret mode, for tests, so :func:`kernel_failure` asks nothing
there. ``python -m m3jax.selfcheck`` is the command line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax

from m3jax.atomic import atomic_write
from m3jax.pallas import _backend
from m3jax.pallas.canaries import CANARIES, SHARED_SOURCES, Canary, compare, of_kernel, paths_for

DEFAULT_DEADLINE_S = 180.0
_STARTUP_S = 60.0  # a worker's own start (importing JAX) before its first canary, on top of the deadline
_TAG = "m3jax-selfcheck "  # marks the worker's report lines among whatever else reaches its stdout
_PKG_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the m3jax package


@dataclasses.dataclass
class Verdict:
    canary: str  # kernel@path
    target: str  # sm_90a / sm_100a / interpret
    device: str
    status: str  # "pass" | "fail" | "hung" | "n/a" (the target has no such path: Canary.unsupported)
    max_error: float | None  # max |got - ref| (floats) or the number of differing entries (ids)
    seconds: float  # canary wall time, compilation included
    error: str | None = None
    cached: bool = False

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def sound(self) -> bool:
        """Nothing wrong with the kernel here: it passed, or the target has no such path (the model never
        takes it there, and a kernel_failure for it still says why)."""
        return self.status in ("pass", "n/a")

    @property
    def kernel(self) -> str:
        return self.canary.split("@")[0]


# ---- keys -------------------------------------------------------------------------------------------


def device_key() -> dict:
    """Where a verdict holds: the GPU's name, compute capability and driver, or interpret mode off-GPU."""
    d = jax.devices()[0]
    if jax.default_backend() == "gpu":  # the real backend (tests stand in for a GPU by patching this function)
        cc = str(getattr(d, "compute_capability", "?"))
        return {"device": f"{d.device_kind} (sm_{cc.replace('.', '')})", "target": _backend.current_target().name,
                "driver": str(getattr(d.client, "platform_version", "?"))}
    return {"device": f"{d.device_kind} interpret", "target": "interpret", "driver": "-"}


_SOURCE_HASHES: dict[str, str] = {}  # per canary; the model asks at every kernel call it traces


def source_hash(canary: Canary) -> str:
    """Hash of the kernel's source files (read once per process: the files a process imported do not
    change under it)."""
    if canary.name not in _SOURCE_HASHES:
        h = hashlib.sha256()
        for p in (*SHARED_SOURCES, *canary.sources):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        _SOURCE_HASHES[canary.name] = h.hexdigest()[:16]
    return _SOURCE_HASHES[canary.name]


def _key(canary: Canary, dev: dict) -> str:
    return (f"{canary.name}|{dev['device']}|{dev['target']}|driver {dev.get('driver', '-')}|jax {jax.__version__}|"
            f"{source_hash(canary)}")


# ---- the cache file ---------------------------------------------------------------------------------


def cache_path() -> Path:
    root = os.environ.get("M3JAX_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "m3jax") / "selfcheck.json"


_FIELDS = {f.name for f in dataclasses.fields(Verdict)} - {"cached"}


def _load() -> dict:
    """The file's verdicts by key; {} when absent. A file that is not the JSON this module writes is
    ignored with a warning (the next verdict rewrites it), and so is any entry that is not a verdict."""
    path = cache_path()
    try:
        data = json.loads(path.read_text())
        entries = data["verdicts"]
        if not isinstance(entries, dict):
            raise TypeError("'verdicts' is not an object")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:  # truncated, edited, not ours
        warnings.warn(f"m3jax self-check: ignoring the verdict cache {path} ({type(e).__name__}: {e}); "
                      "the canaries run again and the file is rewritten", RuntimeWarning, stacklevel=3)
        return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict) and set(v) == _FIELDS}


def _save(key: str, verdict: Verdict) -> None:
    path = cache_path()
    with warnings.catch_warnings():  # a bad file was named when it was read
        warnings.simplefilter("ignore")
        entries = _load()  # re-read: another process may have added verdicts since
    entries[key] = {k: v for k, v in dataclasses.asdict(verdict).items() if k in _FIELDS}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"verdicts": entries}, indent=1, sort_keys=True))
    except OSError as e:  # a read-only home still runs; the canaries just run again next time
        warnings.warn(f"m3jax self-check: cannot write {path}: {e}", RuntimeWarning, stacklevel=3)


# ---- running a canary -------------------------------------------------------------------------------


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def run_canary(canary: Canary, dev: dict) -> Verdict:
    """Run one canary in this process (the worker's job; tests call it directly)."""
    if canary.unsupported is not None and (why := canary.unsupported()):
        return Verdict(canary.name, dev["target"], dev["device"], "n/a", None, 0.0, why)
    interpret = dev["target"] == "interpret"
    t0 = time.perf_counter()
    status, err, why = "fail", None, None
    try:
        if interpret:
            _backend.reset_interpret_state()
        got, ref = jax.block_until_ready(canary.run())
        passed, err, why = compare(got, ref, canary.tol)
        if interpret and _backend.interpret_races_found():
            passed, why = False, "the interpret-mode race detector fired"
        status = "pass" if passed else "fail"
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile or launch here fails its canary)
        why = _first_line(e)
        if interpret:
            _backend.reset_interpret_state()
    return Verdict(canary.name, dev["target"], dev["device"], status, err, round(time.perf_counter() - t0, 3), why)


def deadline_s() -> float:
    raw = os.environ.get("M3JAX_SELFCHECK_DEADLINE", "")
    if not raw:
        return DEFAULT_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"M3JAX_SELFCHECK_DEADLINE must be a positive number of seconds, got {raw!r}")
    return value


def _worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PKG_ROOT), env.get("PYTHONPATH")) if p)
    # The model's process may hold most of the GPU's memory: the worker takes only what it uses.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def run_isolated(canaries: list[Canary], dev: dict, deadline: float | None = None) -> list[Verdict]:
    """Run canaries in a worker process, each within ``deadline`` seconds (:func:`deadline_s`). The
    worker reports each canary as it starts and ends; one past its deadline is killed with the worker
    and marked "hung" (one that ends the worker, "fail"), and the canaries after it run in a new
    worker."""
    deadline = deadline_s() if deadline is None else deadline
    verdicts: list[Verdict] = []
    pending = list(canaries)
    while pending:
        argv = [sys.executable, "-m", "m3jax.pallas.verdicts", *(f"{c.run.__module__}:{c.name}" for c in pending)]
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=_worker_env(), start_new_session=True)
        except OSError as e:
            error = f"the worker process did not start: {_first_line(e)}"
            return verdicts + [Verdict(c.name, dev["target"], dev["device"], "fail", None, 0.0, error) for c in pending]
        lines: queue.Queue = queue.Queue()
        out_reader = threading.Thread(target=lambda: [lines.put(s) for s in proc.stdout] + [lines.put(None)],
                                      daemon=True)
        out_reader.start()
        stderr: list[str] = []
        err_reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
        err_reader.start()
        current, started, allowed = pending[0], time.perf_counter(), deadline + _STARTUP_S
        try:
            while pending:
                try:
                    line = lines.get(timeout=max(0.0, started + allowed - time.perf_counter()))
                except queue.Empty:
                    seconds = round(time.perf_counter() - started, 3)
                    verdicts.append(Verdict(current.name, dev["target"], dev["device"], "hung", None, seconds,
                                            f"no result within the {deadline:g} s deadline; killed"))
                    pending.remove(current)
                    break
                if line is None:  # the worker died (a crash in the driver, an abort): this canary fails
                    proc.wait()
                    err_reader.join(timeout=5)
                    tail = "".join(stderr).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
                    error = f"the worker process ended during the canary: {tail[0][:300]}"
                    seconds = round(time.perf_counter() - started, 3)
                    verdicts.append(Verdict(current.name, dev["target"], dev["device"], "fail", None, seconds, error))
                    pending.remove(current)
                    break
                if not line.startswith(_TAG):  # the canary's own output
                    continue
                msg = json.loads(line[len(_TAG):])
                if "start" in msg:
                    current = next(c for c in pending if c.name == msg["start"])
                    started, allowed = time.perf_counter(), deadline
                else:
                    v = Verdict(**msg)
                    verdicts.append(v)
                    pending = [c for c in pending if c.name != v.canary]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for reader, stream in ((out_reader, proc.stdout), (err_reader, proc.stderr)):
                reader.join(timeout=5)  # at the pipe's end once the worker is gone
                stream.close()
    order = {c.name: i for i, c in enumerate(canaries)}
    return sorted(verdicts, key=lambda v: order[v.canary])


def _worker(specs: list[str]) -> None:
    """Worker process: run ``module:canary`` specs in order, one JSON line as each starts and ends."""
    dev = device_key()
    for spec in specs:
        module, name = spec.split(":", 1)
        canary = importlib.import_module(module).CANARIES[name]
        print(_TAG + json.dumps({"start": name}), flush=True)
        v = run_canary(canary, dev)
        print(_TAG + json.dumps({k: x for k, x in dataclasses.asdict(v).items() if k != "cached"}), flush=True)


# ---- verdicts and the model's choice ----------------------------------------------------------------

_MEMO: dict[str, Verdict] = {}  # this process's verdicts (the cache file is read once per key)


def check(canaries: list[Canary], *, force: bool = False, dev: dict | None = None) -> list[Verdict]:
    """The canaries' verdicts on this device: cached for their keys, else run now (together, in one
    worker) and cached."""
    dev = dev or device_key()
    out: dict[str, Verdict] = {}
    todo = []
    stored = None
    for c in canaries:
        key = _key(c, dev)
        if not force and key in _MEMO:
            out[c.name] = _MEMO[key]
            continue
        if not force:
            stored = _load() if stored is None else stored
            if key in stored:
                _MEMO[key] = out[c.name] = Verdict(**stored[key], cached=True)
                continue
        todo.append(c)
    if todo:
        for c, v in zip(todo, run_isolated(todo, dev)):
            _MEMO[_key(c, dev)] = out[c.name] = v
            _save(_key(c, dev), v)
    return [out[c.name] for c in canaries]


_WARNED: set[str] = set()


def _why(kernel: str, v: Verdict) -> str:
    if v.status == "n/a":
        return f"the {kernel} kernel has no path at {v.canary} on {v.device} ({v.error})"
    what = "hung in" if v.status == "hung" else "failed"
    return f"the {kernel} kernel {what} its self-check at {v.canary} on {v.device} ({v.error})"


def _warn_once(tag: str, text: str) -> None:
    if tag not in _WARNED:
        _WARNED.add(tag)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def kernel_failure(*kernels: str, block_size: int | None = None) -> str | None:
    """Why one of these kernels must not be used on this GPU at ``block_size``, or None: the GPU is not
    a target the kernels are built for (sm_120-class, an unknown compute capability), or the canary of
    the path the kernel takes at that block failed or hung (every path's when ``block_size`` is None).
    Named in one warning per canary and process.

    Off the GPU nothing is checked (the kernels run only in interpret mode, for tests).
    """
    dev = device_key()
    if dev["target"] == "interpret":
        return None
    refused = _backend.current_target().refused
    if refused:
        _warn_once("target", f"m3jax: the Mosaic GPU kernels are not used on {dev['device']}: {refused}; "
                             "the reference path runs instead.")
        return refused
    taken = {kernel: paths_for(kernel, block_size) for kernel in kernels}
    wanted = list(dict.fromkeys(c for cs in taken.values() for c in cs))
    found = {c.name: v for c, v in zip(wanted, check(wanted, dev=dev))}  # one worker for all of them
    for kernel, cs in taken.items():
        bad = [found[c.name] for c in cs if not found[c.name].passed]
        if bad:
            reason = _why(kernel, bad[0])
            _warn_once(f"{kernel}|{bad[0].canary}",
                       f"m3jax: {reason}; it is not used at that path (the reference path runs instead where the "
                       "choice is automatic). `python -m m3jax.selfcheck --force` reruns the check.")
            return reason
    return None


def canaries_named(names: list[str]) -> list[Canary]:
    """Canaries by kernel name (all its paths) or by ``kernel@path``; ValueError naming the unknown."""
    out, unknown = [], []
    for n in names:
        found = [CANARIES[n]] if n in CANARIES else of_kernel(n)
        (out.extend(found) if found else unknown.append(n))
    if unknown:
        known = sorted({*CANARIES, *(c.kernel for c in CANARIES.values())})
        raise ValueError(f"unknown kernels or canaries {unknown}; choose from {known}")
    return list(dict.fromkeys(out))


if __name__ == "__main__":  # the worker process of run_isolated
    _worker(sys.argv[1:])
