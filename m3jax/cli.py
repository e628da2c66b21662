"""What every ``python -m m3jax.<tool>`` shares: argument types that refuse bad values by flag name,
and :func:`run`, which turns a user's mistake into one line instead of a traceback.

Exit status of every tool: 0 done, 2 a user error (bad argument, unreadable or unsupported checkpoint or
config, missing file, a folder another process is writing), 1 an error of the environment (a full
disk, a read-only filesystem, an I/O error: one ``error:`` line naming the path) or anything else (a
bug: the traceback is kept), 130 Ctrl-C (one line), 141 a closed output pipe (``| head``: quietly,
as Unix tools do). A tool may give its own meaning to 1 (``m3jax.plan``: the plan does not fit).
``--debug`` or ``M3JAX_DEBUG=1`` shows the traceback of a user or environment error too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn

import jax

from m3jax import distributed
from m3jax.atomic import FolderBusyError, NotARegularFileError, open_regular
from m3jax.config import UnsupportedConfigError
from m3jax.safetensors_io import CheckpointError

DEBUG_ENV = "M3JAX_DEBUG"


class UsageError(ValueError):
    """A command-line value that cannot work, found after parsing (e.g. ``--out`` holds other files)."""


# Errors a user causes and can fix from the message alone. processing.MediaError is turned into a
# one-line SystemExit where it is caught; OSError subclasses cover missing, unreadable and unwritable paths.
USER_ERRORS = (
    UsageError,
    FolderBusyError,
    NotARegularFileError,
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
    except BrokenPipeError:
        _quiet_broken_pipe()
        raise SystemExit(141) from None
    except KeyboardInterrupt as e:
        if debug:
            _fail_others(e, 130)
            raise
        _exit(130, "interrupted (Ctrl-C)")
    except OSError as e:  # the environment (no space, read-only, I/O): one line naming the path
        if debug:
            _fail_others(e, 1)
            raise
        _exit(1, os_error_line(e))
    except BaseException as e:  # a bug: the traceback is kept; the job's other processes stop too
        _fail_others(e, 1)
        raise
    try:
        sys.stdout.flush()  # a pipe closed after the last write fails here, not in the interpreter's exit
    except BrokenPipeError:
        _quiet_broken_pipe()
        raise SystemExit(141) from None
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


def os_error_line(e: OSError) -> str:
    """One line for an OSError: what failed and the path(s), without the errno's brackets."""
    what = e.strerror or str(e)
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{what}: {' -> '.join(paths)}" if paths else what


def _quiet_broken_pipe() -> None:
    """The reader of stdout went away: point stdout at /dev/null, so the interpreter's final flush of
    what is still buffered does not print a second BrokenPipeError on the way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


# --------------------------------------------------------------------------------------------------
# argparse types: the value is checked where it enters, and argparse names the flag in the error.


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def finite_float(text: str) -> float:
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


def host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def add_distributed_arguments(ap: argparse.ArgumentParser) -> None:
    """The multi-process flags, the same on every tool."""
    g = ap.add_argument_group("several processes (one job over several hosts; docs: README 'Several hosts')")
    g.add_argument("--coordinator", metavar="HOST:PORT", type=host_port, default=None,
                   help="address of process 0's coordination service (default: what JAX detects: SLURM, Open MPI, "
                        "$JAX_COORDINATOR_ADDRESS; none: one process)")
    g.add_argument("--num-processes", type=positive_int, default=None, metavar="N",
                   help="processes in the job (default: detected, else 1)")
    g.add_argument("--process-id", type=nonnegative_int, default=None, metavar="I",
                   help="this process's index in [0, N) (default: detected)")
    g.add_argument("--heartbeat-timeout", type=positive_int, default=distributed.HEARTBEAT_TIMEOUT_S, metavar="S",
                   help=f"seconds without a heartbeat before a process counts as dead and the others stop, "
                        f"naming it (default {distributed.HEARTBEAT_TIMEOUT_S}; JAX's own heartbeat, twice that, "
                        "aborts as a backstop)")
    g.add_argument("--init-timeout", type=positive_int, default=distributed.INIT_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for every process to join at start (default {distributed.INIT_TIMEOUT_S})")


def seed(text: str) -> int:
    """A random seed: any integer JAX's PRNG keys take (64-bit signed)."""
    value = _int(text)
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits (in [-2**63, 2**63)), got {value}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def nonnegative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    value = finite_float(text)
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


class FileText(str):
    """A file's text (a str) that remembers its ``path``: an output must not overwrite it."""

    path: Path


def utf8_file(text: str) -> FileText:
    """The contents of a UTF-8 text file (refused by name when it is a FIFO, a device or a folder)."""
    path = Path(text)
    try:
        with open_regular(path, "the file") as f:
            out = FileText(f.read().decode("utf-8"))
        out.path = path
        return out
    except NotARegularFileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
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


def refuse_overwriting_inputs(output: Path | None, flag: str, inputs: dict[str, Path | str | None]) -> None:
    """Refuse, before any work, an output path that is one of the run's inputs ({what: path}): the same
    file (or a hard link to it), or an existing file inside an input folder (a checkpoint's weights or
    config). A new file in an input folder is fine: it replaces nothing."""
    if output is None:
        return
    out = Path(output)
    for what, p in inputs.items():
        if p is None:
            continue
        p = Path(p)
        same = out.exists() and p.exists() and os.path.samefile(out, p)
        inside = p.is_dir() and out.exists() and out.resolve().is_relative_to(p.resolve())
        if same or inside:
            raise UsageError(f"{flag} {out} would overwrite {what} {p}{' (a file in it)' if inside else ''}, an input "
                             "of this run; write it elsewhere")


# Short names for --config-override; any other TextConfig field is given by its own name.
OVERRIDE_ALIASES = {"block": "index_block_size", "topk": "index_topk_blocks"}
CONFIG_OVERRIDE_HELP = ("text-config fields for this run, e.g. block=128,topk=4 or index_cache_dtype=float8_e4m3fn "
                        "or index_score_dtype=float8_e4m3fn (the fp8 indexer)")


def parse_overrides(text: str) -> dict:
    """``block=128,topk=4`` -> {"index_block_size": 128, "index_topk_blocks": 4}; values that read as
    integers are integers (e.g. ``index_cache_dtype=float8_e4m3fn`` stays a string)."""
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise argparse.ArgumentTypeError(f"expected key=value pairs separated by commas, got {part!r}")
        value = value.strip()
        try:
            parsed: int | str = int(value)
        except ValueError:
            parsed = value
        out[OVERRIDE_ALIASES.get(name.strip(), name.strip())] = parsed
    return out


def apply_overrides(cfg, overrides: dict):
    """``cfg`` (an M3Config) with the ``--config-override`` text fields set; an unknown field, or a value
    the config refuses (its message names the field), is a UsageError."""
    if not overrides:
        return cfg
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cfg.text)})
    if unknown:
        raise UsageError(f"--config-override: {unknown} are not text-config fields "
                         f"(short names: {', '.join(OVERRIDE_ALIASES)})")
    try:
        return cfg.replace_text(**overrides)
    except (TypeError, ValueError) as e:  # a value of the wrong type (rope_theta=abc) fails in the config's checks
        raise UsageError(f"--config-override {overrides}: {e}") from None
