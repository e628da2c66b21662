"""Verdicts of the self-check canaries (:mod:`m3jax.pallas.canaries`) on this GPU, and the choice the
model makes from them: a kernel whose canary fails, raises or hangs is not used.

A verdict is kept per canary (a kernel at one tile path) and per key: device name, compute
capability, driver, JAX version and a hash of the kernel's source files and of the canary cases. The
first time the model asks for a kernel on a key with no verdict (:func:`kernel_failure`, called where
the model chooses kernels: ``m3jax.msa.kernels`` and ``m3jax.moe``), its canaries run in worker
processes, up to ``$M3JAX_SELFCHECK_WORKERS`` side by side, each canary with a deadline
(``$M3JAX_SELFCHECK_DEADLINE`` seconds, default 180): a wrong barrier count never returns, and it must
not become the model's hang. :func:`check_kernels` asks for several kernels' verdicts in one batch
ahead of tracing (``m3jax.model.check_kernels_ahead``), or starts that batch in the background
(:class:`Background`: ``generate``'s first run traces and compiles beside it, presuming its canaries pass,
and confirms them before it keeps or runs a program). A canary past its deadline is killed
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

import concurrent.futures
import contextlib
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
from m3jax.envvars import env_count
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


def _remember(key: str, verdict: Verdict) -> None:
    """Keep ``verdict`` for ``key`` in this process (``_MEMO``) and in the cache file."""
    _MEMO[key] = verdict
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


def _no_result(canary: Canary, dev: dict, status: str, seconds: float, why: str) -> Verdict:
    """A verdict reached without the canary's output to compare: n/a, hung, or a worker that failed it."""
    return Verdict(canary.name, dev["target"], dev["device"], status, None, round(seconds, 3), why)


def _not_applicable(canary: Canary, dev: dict) -> Verdict | None:
    """The "n/a" verdict of a canary whose path the target lacks (``Canary.unsupported``), or None."""
    why = canary.unsupported() if canary.unsupported is not None else None
    return _no_result(canary, dev, "n/a", 0.0, why) if why else None


def run_canary(canary: Canary, dev: dict) -> Verdict:
    """Run one canary in this process (the worker's job; tests call it directly)."""
    if (na := _not_applicable(canary, dev)) is not None:
        return na
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


def canary_workers() -> int:
    """Worker processes :func:`run_isolated` runs canaries in side by side: ``$M3JAX_SELFCHECK_WORKERS``,
    default a quarter of the CPU cores, 1 to 4. A canary's time is mostly its kernel's lowering and
    compile on the host, one core each; its GPU work is a few launches."""
    return env_count("M3JAX_SELFCHECK_WORKERS", max(1, min(4, (os.cpu_count() or 1) // 4)))


class _Worker:
    """One worker process, given ``module:canary`` specs one line at a time on its stdin; its report
    lines reach :attr:`lines` (None once its stdout ends: the process is gone)."""

    def __init__(self):
        argv = [sys.executable, "-m", "m3jax.pallas.verdicts"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=_worker_env(), start_new_session=True)
        self.fresh = True  # JAX not imported yet: its first canary also waits for the process's start
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        self.readers = [threading.Thread(target=self._read_stdout, daemon=True),
                        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True)]
        for r in self.readers:
            r.start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, canary: Canary, dev: dict, deadline: float) -> tuple[Verdict, bool]:
        """``canary``'s verdict, and whether this worker can take another."""
        started = time.perf_counter()
        allowed = deadline + (_STARTUP_S if self.fresh else 0.0)
        self.fresh = False
        try:
            self.proc.stdin.write(f"{canary.run.__module__}:{canary.name}\n")
            self.proc.stdin.flush()
        except OSError:  # the worker is gone before its canary began: read on to its end, named below
            pass
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, started + allowed - time.perf_counter()))
            except queue.Empty:
                why = f"no result within the {deadline:g} s deadline; killed"
                return _no_result(canary, dev, "hung", time.perf_counter() - started, why), False
            if line is None:  # the worker died (a crash in the driver, an abort): this canary fails
                self.proc.wait()
                self.readers[1].join(timeout=5)
                tail = "".join(self.stderr).strip().splitlines()[-1:] or [f"exit status {self.proc.returncode}"]
                return _no_result(canary, dev, "fail", time.perf_counter() - started,
                                  f"the worker process ended during the canary: {tail[0][:300]}"), False
            if not line.startswith(_TAG):  # the canary's own output
                continue
            msg = json.loads(line[len(_TAG):])
            if "start" in msg:
                started, allowed = time.perf_counter(), deadline
            else:
                return Verdict(**msg), True

    def close(self) -> None:
        """End the process (killed if it is still running: a hung canary), and its pipes' readers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for reader, stream in zip(self.readers, (self.proc.stdout, self.proc.stderr)):
            reader.join(timeout=5)  # at the pipe's end once the worker is gone
            stream.close()
        with contextlib.suppress(OSError):  # a line still buffered for a worker that is gone
            self.proc.stdin.close()


def _serve(todo: queue.SimpleQueue, dev: dict, deadline: float, out: list[Verdict]) -> None:
    """One worker slot of :func:`run_isolated`: take canaries from ``todo`` until it is empty, in one
    worker process while it lasts, a new one after a canary that hung or ended it."""
    worker = None
    try:
        while True:
            try:
                canary = todo.get_nowait()
            except queue.Empty:
                return
            if worker is None:
                try:
                    worker = _Worker()
                except OSError as e:
                    out.append(_no_result(canary, dev, "fail", 0.0,
                                          f"the worker process did not start: {_first_line(e)}"))
                    continue
            try:
                v, reusable = worker.run(canary, dev, deadline)
            except Exception as e:  # noqa: BLE001  (a report line that does not parse: the canary fails, not the run)
                why = f"the worker's report did not parse: {_first_line(e)}"
                v, reusable = _no_result(canary, dev, "fail", 0.0, why), False
            out.append(v)
            if not reusable:
                worker.close()
                worker = None
    finally:
        if worker is not None:
            worker.close()


def run_isolated(canaries: list[Canary], dev: dict, deadline: float | None = None,
                 workers: int | None = None) -> list[Verdict]:
    """Run canaries in worker processes, up to ``workers`` (:func:`canary_workers`) side by side, each
    canary going to the next free worker (the long ones, ``Canary.long``, first), each within ``deadline``
    seconds (:func:`deadline_s`; a new worker's start is allowed on top). A worker reports each canary as
    it starts and ends; one past its deadline is killed with its worker and marked "hung" (one that ends
    its worker, "fail"), and the next canary of that slot starts a new worker. Verdicts in the order of
    ``canaries``."""
    deadline = deadline_s() if deadline is None else deadline
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for c in sorted(canaries, key=lambda c: not c.long):
        todo.put(c)
    out: list[Verdict] = []
    slots = [threading.Thread(target=_serve, args=(todo, dev, deadline, out), daemon=True)
             for _ in range(min(len(canaries), workers or canary_workers()))]
    for t in slots:
        t.start()
    for t in slots:
        t.join()
    order = {c.name: i for i, c in enumerate(canaries)}
    return sorted(out, key=lambda v: order[v.canary])


def _worker() -> None:
    """Worker process: run the ``module:canary`` spec of each line of stdin, one JSON line as each
    starts and ends, until stdin ends."""
    dev = device_key()
    for line in sys.stdin:
        module, name = line.strip().split(":", 1)
        canary = importlib.import_module(module).CANARIES[name]
        print(_TAG + json.dumps({"start": name}), flush=True)
        v = run_canary(canary, dev)
        print(_TAG + json.dumps({k: x for k, x in dataclasses.asdict(v).items() if k != "cached"}), flush=True)


# ---- verdicts and the model's choice ----------------------------------------------------------------

_MEMO: dict[str, Verdict] = {}  # this process's verdicts (the cache file is read once per key)
# key -> the background batch (:class:`Background`) running its canary; while it runs, the model's
# questions presume the canary passes (:func:`kernel_failure`)
_IN_FLIGHT: dict[str, concurrent.futures.Future] = {}


def _presumed(canary: Canary, dev: dict) -> Verdict:
    return Verdict(canary.name, dev["target"], dev["device"], "pass", None, 0.0,
                   "presumed: its canary is still running", cached=True)


def _known(key: str, stored: dict) -> Verdict | None:
    """The verdict this process or the cache file (``stored``, as read) holds for ``key``, or None."""
    if key not in _MEMO and key in stored:
        _MEMO[key] = Verdict(**stored[key], cached=True)
    return _MEMO.get(key)


def check(canaries: list[Canary], *, force: bool = False, dev: dict | None = None,
          presume: bool = False) -> list[Verdict]:
    """The canaries' verdicts on this device: cached for their keys, else run now (together, in
    :func:`run_isolated`'s side-by-side workers) and cached. A canary a :class:`Background` batch is
    running is waited for, or with ``presume`` taken as passing (:func:`kernel_failure`)."""
    dev = dev or device_key()
    out: dict[str, Verdict] = {}
    todo = []
    stored = None
    for c in canaries:
        key = _key(c, dev)
        running = None if force else _IN_FLIGHT.get(key)
        if running is not None:
            if presume:
                out[c.name] = _presumed(c, dev)
                continue
            running.exception()  # waits; a batch that raised leaves no verdict, and the canary runs below
        if not force:
            if key not in _MEMO and stored is None:
                stored = _load()
            if (v := _known(key, stored or {})) is not None:
                out[c.name] = v
                continue
        todo.append(c)
    if todo:
        for c, v in zip(todo, run_isolated(todo, dev)):
            _remember(_key(c, dev), v)
            out[c.name] = v
    return [out[c.name] for c in canaries]


class CanaryFailed(RuntimeError):
    """A canary of a :class:`Background` batch did not pass: what was traced while it ran presumed it
    would, and must be traced again (the model's questions now read its verdict)."""

    def __init__(self, failed: list[Verdict]):
        self.failed = failed
        super().__init__("; ".join(f"{v.canary} {v.status} ({v.error})" for v in failed))


class Background:
    """Canaries run in worker processes while the caller goes on (:func:`check_kernels` with
    ``wait=False``): a first run's self-check beside the weights' load and the programs' compile.
    Until the batch ends, :func:`kernel_failure` presumes each of its canaries passes, so whoever starts
    one must :meth:`confirm` before running or keeping anything traced meanwhile, and trace again when
    it raises. Canaries of a path the target lacks get their "n/a" verdicts at once, not presumed."""

    def __init__(self, canaries: list[Canary], dev: dict):
        self.started = time.perf_counter()
        self.seconds = 0.0  # the batch's wall time, once it ended
        self.wait_s = 0.0  # what confirm() waited for it
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._keys = {c.name: _key(c, dev) for c in canaries}
        if not canaries:
            self._future.set_result([])
            return
        for key in self._keys.values():
            _IN_FLIGHT[key] = self._future
        threading.Thread(target=self._run, args=(canaries, dev), daemon=True, name="m3jax-selfcheck").start()

    def _run(self, canaries: list[Canary], dev: dict) -> None:
        try:
            got = run_isolated(canaries, dev)
            for c, v in zip(canaries, got):
                _remember(self._keys[c.name], v)
            self.seconds = time.perf_counter() - self.started
            self._future.set_result(got)
        except BaseException as e:  # noqa: BLE001  (handed to whoever waits; the canaries run again on demand)
            self._future.set_exception(e)
        finally:
            for key in self._keys.values():
                if _IN_FLIGHT.get(key) is self._future:
                    del _IN_FLIGHT[key]

    def wait(self) -> list[Verdict]:
        """The batch's verdicts, in the order given, once it ends."""
        return self._future.result()

    def confirm(self) -> None:
        """Wait for the batch; CanaryFailed naming the canaries that did not pass."""
        t0 = time.perf_counter()
        try:
            got = self.wait()
        finally:
            self.wait_s += time.perf_counter() - t0
        failed = [v for v in got if not v.passed]
        if failed:
            raise CanaryFailed(failed)


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
    # one batch of workers for all of them; a canary a Background batch runs is presumed to pass
    found = {c.name: v for c, v in zip(wanted, check(wanted, dev=dev, presume=True))}
    for kernel, cs in taken.items():
        bad = [found[c.name] for c in cs if not found[c.name].passed]
        if bad:
            reason = _why(kernel, bad[0])
            _warn_once(f"{kernel}|{bad[0].canary}",
                       f"m3jax: {reason}; it is not used at that path (the reference path runs instead where the "
                       "choice is automatic). `python -m m3jax.selfcheck --force` reruns the check.")
            return reason
    return None


def check_kernels(kernels: dict[str, int | None], *, wait: bool = True) -> list[Verdict] | Background:
    """The verdicts of these kernels at the paths each takes (kernel -> block size; None: every path),
    the missing ones run now in one batch of side-by-side workers (:func:`check`), so that the
    :func:`kernel_failure` calls made later, while tracing, read them instead of each waiting for a
    worker of its own. Nothing off the GPU or on a target the kernels refuse.

    ``wait=False`` returns at once a :class:`Background` batch of the missing canaries (cached verdicts
    are read first; a canary another batch is running is left to it), which the caller confirms."""
    dev = device_key()
    skip = dev["target"] == "interpret" or _backend.current_target().refused
    wanted = [] if skip else list(dict.fromkeys(c for k, bs in kernels.items() for c in paths_for(k, bs)))
    if wait:
        return check(wanted, dev=dev)
    stored = _load() if wanted else {}
    todo = []
    for c in wanted:
        key = _key(c, dev)
        if key in _IN_FLIGHT or _known(key, stored) is not None:
            continue
        if (na := _not_applicable(c, dev)) is not None:  # known now: nothing to presume
            _remember(key, na)
            continue
        todo.append(c)
    return Background(todo, dev)


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


if __name__ == "__main__":  # a worker process of run_isolated
    _worker()
