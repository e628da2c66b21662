"""What every ``python -m m3jax.<tool>`` shares: argument types that refuse bad values by flag name,
and :func:`run`, which turns a user's mistake into one line instead of a traceback.

Exit status of every tool: 0 done, 2 a user error (bad argument, unreadable or unsupported checkpoint or
config, missing file), 1 anything else (a bug: the traceback is kept). A tool may give its own meaning
to 1 (``m3jax.plan``: the plan does not fit). ``--debug`` or ``M3JAX_DEBUG=1`` shows the traceback of
a user error too.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn

import jax

from m3jax import distributed
from m3jax.config import UnsupportedConfigError
from m3jax.safetensors_io import CheckpointError

DEBUG_ENV = "M3JAX_DEBUG"


class UsageError(ValueError):
    """A command-line value that cannot work, found after parsing (e.g. ``--out`` holds other files)."""


# Errors a user causes and can fix from the message alone. processing.MediaError is turned into a
# one-line SystemExit where it is caught; OSError subclasses cover missing, unreadable and unwritable paths.
USER_ERRORS = (
    UsageError,
    UnsupportedConfigError,
    CheckpointError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one ``error:`` line, like every other user error (the usage block
    printed before it buried the line that matters; ``--help`` still prints it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")


def add_debug_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--debug", action="store_true",
                    help=f"show the Python traceback of an error, not just its message (also {DEBUG_ENV}=1)")


def run(main: Callable[[list[str]], Any], argv: list[str] | None = None,
        exit_code: Callable[[Any], int] | None = None) -> NoReturn:
    """Run a tool's ``main(argv)`` and exit: with ``exit_code(result)`` (default 0, or ``result`` when it
    is an int); a user error prints ``error: <message>`` on stderr and exits 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        result = main(argv)
    except USER_ERRORS as e:
        if debug:
            _fail_others(e, 2)
            raise
        _exit(2, str(e))
    except SystemExit as e:
        # The tools' own refusals are SystemExit("message"): the same one line, the same status.
        if isinstance(e.code, str):
            _exit(2, e.code)
        if e.code not in (0, None):
            _fail_others(e, e.code if isinstance(e.code, int) else 1)
        raise
    except BaseException as e:  # a bug: the traceback is kept; the job's other processes stop too
        _fail_others(e, 1)
        raise
    if exit_code is not None:
        raise SystemExit(exit_code(result))
    raise SystemExit(result if isinstance(result, int) else 0)


def _exit(code: int, message: str) -> NoReturn:
    """Print ``error: <message>`` (naming this process when the job has several) and exit ``code``."""
    if distributed.active():
        message = f"process {jax.process_index()}: {message}"
    print(f"error: {message}", file=sys.stderr)
    distributed.fail(message, code)
    raise SystemExit(code) from None


def _fail_others(e: BaseException, code: int) -> None:
    """In a job of several processes: print the traceback, tell the others and exit (distributed.fail)."""
    if distributed.active():
        traceback.print_exc()
        distributed.fail(f"process {jax.process_index()}: {type(e).__name__}: {e}", code)


# --------------------------------------------------------------------------------------------------
# argparse types: the value is checked where it enters, and argparse names the flag in the error.


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seed(text: str) -> int:
    """A random seed: any integer JAX's PRNG keys take (64-bit signed)."""
    value = _int(text)
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits (in [-2**63, 2**63)), got {value}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def nonnegative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def token_ids(text: str) -> list[int]:
    """Comma-separated non-negative token ids (the vocabulary bound is checked once the config is known)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated token ids, got none")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integer token ids, got {text!r}") from None
    negative = [i for i in ids if i < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {negative[0]}")
    return ids


def utf8_file(text: str) -> str:
    """The contents of a UTF-8 text file."""
    path = Path(text)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from None


def writable_file(text: str) -> Path:
    """A file path that can be written now: its folder exists and is writable, and it is not a folder.
    Checked before any work starts, so a typo does not cost a whole run."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{path} is not writable")
    return path
