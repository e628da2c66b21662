"""Several processes of one job (JAX's multi-controller runtime): every host runs the same command
on its own devices, and one mesh spans all of them.

* :func:`m3jax.cli.add_distributed_arguments` gives a tool ``--coordinator HOST:PORT --num-processes N --process-id I``
  and the two timeouts; :func:`initialize` starts ``jax.distributed`` from them, or from what JAX
  detects itself (SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS``), or not at all (one process).
* One voice: only process 0 prints, shows progress and writes files (:func:`is_voice`).
* The job is one job: the parsed arguments of every process are compared at the start (a mismatch
  is refused, naming the flag and the processes), and :func:`check_same` compares a digest of what
  each process computed (the generated ids) at the end.
* Failure: a process that stops on an error publishes it in the coordination service before it
  exits; a watchdog thread in every other process reads it and exits at once, naming that process.
  A process that dies without a word (killed, a lost node) is found by JAX's heartbeat: the
  survivors abort after ``--heartbeat-timeout`` seconds with JAX's log line naming the task.
  A process that cannot reach the coordinator gives up after ``--init-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

# Seconds without a heartbeat before the coordination service declares a process dead and every
# other process aborts (JAX's own default is 100 s); seconds a process waits for all others to
# join at start-up (JAX's default 300 s).
HEARTBEAT_TIMEOUT_S = 30
INIT_TIMEOUT_S = 300
# How often the watchdog reads the failures other processes published.
_POLL_S = 0.5
_PREFIX = "m3jax/"

_state = {"on": False, "failing": False, "watchdog": None}


def _detected() -> bool:
    """Whether the environment describes a job of more than one process that JAX can read."""
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        return True
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")):
        return int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))) > 1
    if "OMPI_COMM_WORLD_SIZE" in env:
        return int(env["OMPI_COMM_WORLD_SIZE"]) > 1
    return False


def initialize(args: argparse.Namespace) -> bool:
    """Join the job described by ``args`` (see :func:`m3jax.cli.add_distributed_arguments`) or by the environment; returns
    whether this is one of several processes. Then the parsed arguments are compared across the
    processes (a mismatch exits with status 2 on every process) and, on processes other than 0,
    ``args.quiet`` is set (one voice). Call before anything touches a JAX device."""
    explicit = (args.coordinator, args.num_processes, args.process_id)
    if args.num_processes == 1 or (explicit == (None, None, None) and not _detected()):
        if args.process_id not in (None, 0):
            raise SystemExit(f"--process-id {args.process_id} with one process")
        return False
    if _state["on"] or _client() is not None:  # already joined (a second main() in one process)
        raise SystemExit("jax.distributed is already initialized in this process")
    if args.num_processes is not None and args.process_id is not None and args.process_id >= args.num_processes:
        raise SystemExit(f"--process-id {args.process_id} is not below --num-processes {args.num_processes}")
    # CPU devices need a collectives backend across processes (GPUs use NCCL); harmless elsewhere.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   initialization_timeout=args.init_timeout,
                                   heartbeat_timeout_seconds=args.heartbeat_timeout)
    except (RuntimeError, ValueError) as e:  # the coordinator did not answer, or nothing to detect
        raise SystemExit(f"cannot join the job (coordinator {args.coordinator or 'detected'}): "
                         f"{str(e).splitlines()[0]}") from None
    _state["on"] = True
    _start_watchdog()
    _check_arguments(args)
    if not is_voice():
        args.quiet = True
    return True


def active() -> bool:
    """Whether this process is one of several of one job."""
    return _state["on"]


def is_voice() -> bool:
    """Whether this process prints and writes files: process 0 (or the only one)."""
    return jax.process_index() == 0


def _client():
    from jax._src import distributed as jd  # the coordination service's key-value store has no public API

    return jd.global_state.client


def _all_values(key: str, timeout_s: float) -> dict[int, str]:
    """{process: value} of ``key`` published by every process (waits up to ``timeout_s`` for each)."""
    c = _client()
    return {p: c.blocking_key_value_get(f"{_PREFIX}{key}/{p}", int(timeout_s * 1000))
            for p in range(jax.process_count())}


def _publish(key: str, value: str) -> None:
    _client().key_value_set(f"{_PREFIX}{key}/{jax.process_index()}", value)


def _comparable(args: argparse.Namespace) -> dict[str, str]:
    """The parsed arguments every process must share: all but the process's own index and --quiet
    (the processes other than 0 are quiet anyway)."""
    return {k: repr(v) for k, v in sorted(vars(args).items()) if k not in ("process_id", "quiet")}


def _check_arguments(args: argparse.Namespace) -> None:
    mine = _comparable(args)
    _publish("args", json.dumps(mine))
    everyone = {p: json.loads(v) for p, v in _all_values("args", args.init_timeout).items()}
    for p, theirs in everyone.items():
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if diff:
            k = diff[0]
            flag = "--" + k.replace("_", "-")
            raise SystemExit(f"arguments differ between processes: {flag} is {mine.get(k)} on process "
                             f"{jax.process_index()} and {theirs.get(k)} on process {p}"
                             + (f" (and {len(diff) - 1} more: {', '.join(diff[1:])})" if len(diff) > 1 else "")
                             + "; every process must run the same command")


def barrier(name: str, timeout_s: float) -> None:
    """Wait until every process reaches ``name`` (one process: returns at once)."""
    if active():
        _client().wait_at_barrier(f"{_PREFIX}{name}", int(timeout_s * 1000))


def from_voice(value):
    """Process 0's ``value`` (an int, float or bool) on every process: a decision only it may take
    (a wall-clock budget, a timing) so that all processes run the same steps. A collective."""
    if not active():
        return value
    return type(value)(multihost_utils.broadcast_one_to_all(np.asarray(value)).item())


def to_host(x) -> np.ndarray:
    """``x`` as a host array on every process: a value split over several processes' devices is
    gathered first (a collective: every process must call it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def digest(values) -> str:
    """sha256 of a JSON-serialisable value (e.g. the generated ids)."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def check_same(name: str, values, timeout_s: float = INIT_TIMEOUT_S) -> str:
    """Compare the digest of ``values`` across the processes; raises RuntimeError naming the processes
    whose ``name`` differs from process 0's. Returns the digest (one process: just computes it)."""
    d = digest(values)
    if not active():
        return d
    _publish(f"digest/{name}", d)
    everyone = _all_values(f"digest/{name}", timeout_s)
    differ = [p for p, v in everyone.items() if v != everyone[0]]
    if differ:
        raise RuntimeError(f"{name} differ between processes: process(es) {differ} computed other {name} than "
                           f"process 0 (sha256 {everyone[differ[0]][:12]} vs {everyone[0][:12]})")
    return d


# --------------------------------------------------------------------------------------------------
# Failure


def fail(message: str, code: int) -> None:
    """Stop this process on an error, after telling the others (their watchdogs exit naming it). Does
    not run JAX's shutdown barrier, which would wait for processes that may be stuck in a collective."""
    if not active():
        return
    _state["failing"] = True  # this process's own message is the one to give, not a peer's
    try:
        _publish("failed", message)
        time.sleep(2 * _POLL_S)  # process 0 hosts the store: give the others a read of it
    except Exception:  # noqa: BLE001 - the coordinator itself may be gone; exit anyway
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start_watchdog() -> None:
    me = jax.process_index()

    stop = threading.Event()

    def watch():
        c = _client()
        while not stop.wait(_POLL_S):
            try:
                failed = c.key_value_dir_get(f"{_PREFIX}failed/")
            except Exception:  # noqa: BLE001 - JAX's heartbeat aborts this process if the coordinator is gone
                continue
            others = [(int(k.rsplit("/", 1)[1]), v) for k, v in failed if not k.endswith(f"/{me}")]
            if others and not _state["failing"]:
                p, msg = min(others)
                print(f"error: process {me}: stopping because process {p} failed: {msg}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(1)

    def join():
        # Before JAX's own exit handler shuts the client down (handlers run last registered first): a
        # daemon thread still inside a client call when the interpreter ends aborts the process.
        stop.set()
        t.join()

    t = threading.Thread(target=watch, name="m3jax-distributed-watchdog", daemon=True)
    t.start()
    atexit.register(join)
    _state["watchdog"] = t
