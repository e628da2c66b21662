"""What the benchmark scripts share: what an output records beside its numbers (when, UTC; on which
device; with which JAX; the command that reproduces it), and ``--help`` for the scripts that take
positional arguments or environment variables instead of flags."""

from __future__ import annotations

import datetime
import os
import sys


def run_info(script: str, argv: list[str] | None = None, env: tuple[str, ...] = ()) -> dict:
    """``script``: the file name under benchmarks/; ``argv``: its arguments (default: this process's);
    ``env``: the environment variables that configure it, written into the command where set. JAX is
    imported here, not with this module: some benchmarks set XLA's flags before their first import."""
    import jax

    dev = jax.devices()[0]
    args = sys.argv[1:] if argv is None else list(argv)
    settings = [f"{name}={os.environ[name]}" for name in env if name in os.environ]
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "device": f"{dev.device_kind} ({dev.platform})", "jax": jax.__version__,
            "command": " ".join([*settings, "PYTHONPATH=. python", f"benchmarks/{script}", *args])}


def header(info: dict) -> str:
    """One markdown line of :func:`run_info`."""
    return f"{info['date']}, {info['device']}, jax {info['jax']}. Command: `{info['command']}`"


def help_or_run(doc: str) -> None:
    """``-h`` / ``--help`` prints ``doc`` (the script's docstring: what it runs and how to call it) and
    exits, where the script would otherwise take the flag as an argument or start its run."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(doc)
        raise SystemExit(0)
