"""Test-only canaries for the self-check's worker process (tests/test_selfcheck.py): the worker imports
this module by name to find them, as it imports m3jax.pallas.canaries for the real ones."""

from __future__ import annotations

import os
import time

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


CANARIES = {c.name: c for c in (Canary("hang_test", "agrees", _agrees, ()), Canary("hang_test", "sleeps", _hangs, ()),
                                Canary("hang_test", "exits", _ends_the_process, ()))}
