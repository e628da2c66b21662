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
  A process that dies without a word (killed, hung, a lost node) stops the beats its watchdog
  publishes every 0.5 s: the others exit after ``--heartbeat-timeout`` seconds with one line naming
  it (a finished process says so first, then waits in JAX's shutdown without beating). JAX's own
  heartbeat, at twice that timeout, is the backstop: it aborts with JAX's log (the client's callback
  for it is not usable from Python in jax 0.11.2). Losing process 0, which hosts the coordination
  service, is seen at the next poll; JAX's client, which polls the service for errors all the time,
  usually aborts first with its own log ("Failed to send RPC to coordination service").
  A process that cannot reach the coordinator gives up after ``--init-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

# Seconds without a beat of a process's watchdog before the others stop, naming it (JAX's own
# heartbeat default is 100 s); seconds a process waits for all others to join at start-up (JAX's
# default 300 s).
HEARTBEAT_TIMEOUT_S = 30
INIT_TIMEOUT_S = 300
# How often the watchdog beats and reads the failures and beats of the other processes.
_POLL_S = 0.5
# JAX's own heartbeat timeout, as a multiple of --heartbeat-timeout: a backstop that aborts with JAX's
# log (SIGABRT) only if the watchdog did not stop this process first with its one line.
JAX_HEARTBEAT_FACTOR = 2
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
        # JAX's heartbeat is the backstop, behind the watchdog's (which names the process in one line).
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   initialization_timeout=args.init_timeout,
                                   heartbeat_timeout_seconds=JAX_HEARTBEAT_FACTOR * args.heartbeat_timeout)
    except (RuntimeError, ValueError) as e:  # the coordinator did not answer, or nothing to detect
        raise SystemExit(f"cannot join the job (coordinator {args.coordinator or 'detected'}): "
                         f"{str(e).splitlines()[0]}") from None
    _state["on"] = True
    _start_watchdog(args.heartbeat_timeout)
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


def _stop(me: int, why: str) -> None:
    print(f"error: process {me}: stopping because {why}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _start_watchdog(heartbeat_timeout: int) -> None:
    me = jax.process_index()
    stop = threading.Event()

    def watch():
        c = _client()
        beats, seen = 0, {}
        while not stop.wait(_POLL_S):
            now = time.monotonic()
            try:
                beats += 1
                c.key_value_set(f"{_PREFIX}alive/{me}", str(beats), allow_overwrite=True)
                failed = c.key_value_dir_get(f"{_PREFIX}failed/")
                alive = dict(c.key_value_dir_get(f"{_PREFIX}alive/"))
                done = {k.rsplit("/", 1)[1] for k, _ in c.key_value_dir_get(f"{_PREFIX}done/")}
            except Exception:  # noqa: BLE001 - the coordination service (process 0) is gone
                # (JAX's client aborts on such a failure too, often first: its own poll of the service)
                if me != 0 and not _state["failing"]:
                    _stop(me, "lost the coordination service on process 0 (process 0 died, or its host is "
                              "unreachable)")
                continue
            others = [(int(k.rsplit("/", 1)[1]), v) for k, v in failed if not k.endswith(f"/{me}")]
            if others and not _state["failing"]:
                p, msg = min(others)
                _stop(me, f"process {p} failed: {msg}")
            # A peer's count that has not moved for heartbeat_timeout seconds of this process's clock:
            # the peer is dead or cut off (no clocks are compared across hosts).
            for p in range(jax.process_count()):
                if str(p) in done:  # finished (it waits in JAX's shutdown barrier without beating)
                    continue
                count = alive.get(f"{_PREFIX}alive/{p}")
                if p not in seen or seen[p][0] != count:
                    seen[p] = (count, now)
                elif p != me and now - seen[p][1] > heartbeat_timeout and not _state["failing"]:
                    _stop(me, f"process {p} stopped responding for {heartbeat_timeout} s (--heartbeat-timeout: "
                              "killed, hung, or its host lost)")

    def join():
        # Before JAX's own exit handler shuts the client down (handlers run last registered first): a
        # daemon thread still inside a client call when the interpreter ends aborts the process.
        stop.set()
        t.join()
        with contextlib.suppress(Exception):  # the coordination service (process 0) may be gone already
            _publish("done", "1")

    t = threading.Thread(target=watch, name="m3jax-distributed-watchdog", daemon=True)
    t.start()
    atexit.register(join)
    _state["watchdog"] = t
