"""Settings read from the environment: counts of workers, threads and processes (``M3JAX_*``), each
refused with a ValueError naming the variable when it is not a count."""

from __future__ import annotations

import os


def env_count(name: str, default: int) -> int:
    """``$name`` as a count >= 1, ``default`` when unset or blank; ValueError naming it otherwise."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"{name}={raw!r} must be >= 1")
    return n
