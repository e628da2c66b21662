"""Test-only canaries for the self-check's worker process (tests/test_selfcheck.py): the worker imports
this module by name to find them, as it imports m3jax.pallas.canaries for the real ones."""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax.numpy as jnp

from m3jax.pallas.canaries import Canary


def _hangs():
    """A kernel that never returns (a wrong barrier count on a GPU): here it sleeps past any deadline."""
    time.sleep(600)
    raise AssertionError("unreachable: the worker is killed at its deadline")


def _ends_the_process():
    """A kernel that takes its process down (a driver abort, a segfault)."""
    os._exit(3)


def _agrees():
    x = jnp.arange(4, dtype=jnp.float32) * 0.5
    return x + 1.0, jnp.asarray([1.0, 1.5, 2.0, 2.5])


def _notes_its_process():
    """Agrees, after writing its worker's process id to a file of ``$M3JAX_TEST_PID_DIR`` and waiting a
    second, so that a second worker takes the next canary."""
    (Path(os.environ["M3JAX_TEST_PID_DIR"]) / f"{time.time_ns()}.pid").write_text(str(os.getpid()))
    time.sleep(1.0)
    return _agrees()


def _notes_its_turn(name: str):
    """A canary that agrees, after writing a file named by the time and ``name`` to ``$M3JAX_TEST_PID_DIR``:
    the files' order is the order the canaries ran in. (A function of this module: the worker finds the
    canary through its run function's module.)"""
    def run():
        (Path(os.environ["M3JAX_TEST_PID_DIR"]) / f"{time.time_ns()}-{name}").touch()
        return _agrees()

    return run


def _garbles_its_report():
    """Writes a report line that is not JSON (the tag, then anything) before it agrees."""
    print("m3jax-selfcheck {not json", flush=True)
    return _agrees()


CANARIES = {c.name: c for c in (Canary("hang_test", "agrees", _agrees, ()), Canary("hang_test", "sleeps", _hangs, ()),
                                Canary("hang_test", "exits", _ends_the_process, ()))}
# Run by name (verdicts.run_isolated), not asked for by a kernel: kernel_failure("hang_test") takes the three above.
SIDE_BY_SIDE = [Canary("side_test", f"pid{i}", _notes_its_process, ()) for i in range(4)]
GARBLED = Canary("garble_test", "report", _garbles_its_report, ())
# four canaries, the last two long (Canary.long): one worker runs those first
IN_TURN = [Canary("turn_test", f"c{i}", _notes_its_turn(f"c{i}"), (), long=i >= 2) for i in range(4)]
CANARIES.update((c.name, c) for c in (*SIDE_BY_SIDE, GARBLED, *IN_TURN))
