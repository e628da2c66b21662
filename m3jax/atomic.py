"""Writes that a crash, a full disk or a second process cannot leave half done.

* :func:`atomic_write`: a file is written under a unique temporary name beside it, flushed to disk,
  then renamed over the target, so a reader sees the old file or the new one, never a prefix.
* :func:`folder_lock`: one writer per folder. The lock is an ``flock`` on a file beside the folder
  (not inside it: the folder itself is swapped out by :func:`swap_in`); a second writer, in this
  process or another, is refused at once by name instead of interleaving its files with the first's.
  The kernel drops the lock when its holder dies, so a killed writer never leaves the folder locked.
* :func:`staging_folder` + :func:`swap_in`: a folder is built under a unique name beside the target
  and exchanged with it in one ``renameat2(RENAME_EXCHANGE)`` (Linux), so readers that open the
  target by path see all of the old folder or all of the new one. Where the exchange is not
  available, the old folder is first renamed aside (a reader in that instant finds no folder and
  fails by name; it never sees a mix).
* :func:`open_regular`: opens a file the user named for reading, refusing FIFOs, devices and folders
  (a FIFO in place of ``config.json`` would block a reader forever).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path


class FolderBusyError(RuntimeError):
    """Another writer holds the lock of the folder this one was about to write."""


class NotARegularFileError(ValueError):
    """A path that must be a regular file names a FIFO, a device, a socket or a folder."""


def new_save_id() -> str:
    """A fresh identifier for one save: every file of the save records it, so a reader can tell
    files of two saves apart."""
    return uuid.uuid4().hex


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return  # some filesystems do not open folders; the rename is still atomic there
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a unique temporary file in the same folder, fsync'd and
    renamed over ``path``. On any error (a full disk, a read-only folder) the temporary file is
    removed and ``path`` is left as it was; the OSError propagates with the path in it."""
    path = Path(path)
    blob = data.encode() if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return path


def lock_path(folder: str | Path) -> Path:
    """The lock file of ``folder``: beside it, so it stays put when the folder is swapped."""
    folder = Path(folder).resolve()
    return folder.with_name(f".{folder.name}.lock")


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str = "a checkpoint save") -> Iterator[Path]:
    """Hold the exclusive write lock of ``folder`` (its parent must exist) for the ``with`` block.
    A second holder (another process, or another thread of this one) gets :class:`FolderBusyError`
    naming the folder and the lock file. The lock file is left in place after release: removing it
    would let two writers lock two different files of the same name."""
    path = lock_path(folder)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusyError(
                f"{folder} is being written by another process or thread (lock {path} is held); "
                f"refusing {what} into it: wait for that one to finish, or write elsewhere") from None
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def staging_folder(target: str | Path) -> Path:
    """A new empty folder beside ``target`` with a unique name (hidden), for :func:`swap_in`."""
    target = Path(target).resolve()
    path = target.with_name(f".{target.name}.staging-{uuid.uuid4().hex[:12]}")
    path.mkdir()
    return path


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2); False where the call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # old kernel or a filesystem without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in(staging: Path, target: str | Path) -> None:
    """Put the finished folder ``staging`` in place of ``target`` (its sibling) and remove the old one."""
    target = Path(target).resolve()
    for p in staging.iterdir():  # the files' data is on disk before the rename makes them visible
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(staging)
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging)  # now holds the old folder
    else:
        aside = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:12]}")
        os.rename(target, aside)
        os.rename(staging, target)
        shutil.rmtree(aside)
    _fsync_dir(target.parent)


def open_regular(path: str | Path, what: str = "file"):
    """Open ``path`` for binary reading, refusing anything but a regular file by name. The open does
    not block on a FIFO (O_NONBLOCK), and the check is on the descriptor that is then read."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                    "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                    else "not a regular file")
            raise NotARegularFileError(f"{path}: {what} is {kind}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
