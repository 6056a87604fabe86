"""Writing run files so that a crash, a kill or a full disk never leaves one half-written.

* :func:`atomic_write`: a whole file at once (write to a temporary name, flush, fsync, rename over the
  target, fsync the directory): a reader sees the old file or the new one.
* :func:`append_line`: one line appended to a log that is only ever appended to (metrics.jsonl), flushed
  and fsynced; a failed append is cut back, so the file ends with its last complete line.
* :func:`publish_dir`: a directory written aside (``.NAME.new``), fsynced, then swapped in for ``NAME``.

A write the disk refuses (no space, a read-only file system, no permission) raises :class:`RunFileError`:
one line naming the path, the space needed and free, and what to do; the temporary file is removed and the
previous file is left as it was. Kept free of heavy imports: the run lock uses it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO

from fedpeft.errors import UserError

# errors that are the disk's or the directory's, not the program's: they get a one-line RunFileError
DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}
TMP_SUFFIX = ".tmp"
RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) reports the system's error


class RunFileError(UserError, OSError):
    """A run file the disk refused to take (full, read-only, no permission); ``errno`` is the disk's."""


def human_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def free_space(path: Path) -> int | None:
    """Bytes free to this process on the disk that holds ``path`` (its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def refused_write(path: Path, exc: BaseException, *, needed: int | None = None,
                  then: str = "try again") -> RunFileError:
    """The one-line error of a write to ``path`` that failed with ``exc`` (ENOSPC, EROFS, EACCES, ...; or a
    RunFileError about a file inside ``path``); ``then``: what to do once the cause is fixed (e.g. how to
    continue the run)."""
    code = disk_errno(exc)
    if code in DISK_FULL:
        free = free_space(path)
        sizes = ", ".join(x for x in (f"{human_size(needed)} needed" if needed is not None else "",
                                      f"{human_size(free)} free" if free is not None else "") if x)
        error = RunFileError(f"cannot write {path}: no space left on the disk ({sizes or 'no size known'}); free "
                             f"space there, then {then}")
    else:
        what = "read-only file system" if code == errno.EROFS else "permission denied"
        error = RunFileError(f"cannot write {path}: {what}; make {path.parent} writable (or move the run to a "
                             f"writable disk), then {then}")
    error.errno = code
    return error


def disk_errno(exc: BaseException) -> int | None:
    """The system's error number behind ``exc``: an OSError's, or the one safetensors names in its message."""
    if isinstance(exc, OSError):
        return exc.errno
    found = RUST_IO_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


def is_refused_write(exc: BaseException) -> bool:
    """Whether ``exc`` is the disk refusing a write (full, read-only, no permission), a RunFileError included."""
    return disk_errno(exc) in DISK_FULL | READ_ONLY


def temp_name(path: Path) -> Path:
    """Where :func:`atomic_write` stages ``path``: ``.NAME.<pid>.tmp`` next to it (removed, if a crash left
    it, when the run next opens its directory)."""
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable; a no-op where directories
    cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | Callable[[IO[bytes]], None], *, then: str = "try again") -> None:
    """Write ``data`` (bytes, or a function that writes into the open file) to a temporary file, flush it
    to disk, rename it over ``path``: a reader (or a run resumed after a crash) sees the old file or the
    new one, never half of one. A refused write raises :class:`RunFileError` (``then``: what to do after
    fixing the cause); the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        needed = len(data) if isinstance(data, bytes) else None
        with contextlib.suppress(OSError):  # on a read-only mount even removing a missing file fails (EROFS)
            tmp.unlink(missing_ok=True)
        if is_refused_write(exc) and not isinstance(exc, RunFileError):
            raise refused_write(path, exc, needed=needed, then=then) from None
        raise
    fsync_dir(path.parent)


def open_log(path: Path, *, then: str = "try again") -> int:
    """A file descriptor appending to ``path`` (created if missing), for :func:`append_line`."""
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        if is_refused_write(exc):
            raise refused_write(path, exc, then=then) from None
        raise


def append_line(fd: int, line: str, path: Path, *, then: str = "try again") -> None:
    """Append ``line`` (with its newline) to the log open on ``fd`` (:func:`open_log`; no buffer in this
    process) and make it durable. If the disk refuses it, the file is cut back to where it ended (no half
    line) and :class:`RunFileError` is raised."""
    data = line.encode("utf-8")
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as exc:
        if not is_refused_write(exc) or isinstance(exc, RunFileError):
            raise
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise refused_write(path, exc, needed=len(data), then=then) from None


def fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory``, then the directories themselves (deepest first)."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            with open(Path(root) / name, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def staging_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.new")


def replaced_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def publish_dir(staged: Path, final: Path) -> None:
    """Swap the fully written directory ``staged`` in for ``final``: its files are fsynced first, the old
    ``final`` is renamed aside (``.NAME.old``), ``staged`` renamed into place, the old one removed. A crash
    between the two renames leaves ``.NAME.old`` and no ``NAME``: :func:`fedpeft.rundir.remove_leftovers`
    puts the old one back."""
    fsync_tree(staged)
    old = replaced_dir(final)
    if old.exists():  # left by a swap cut short: keep the newer of the two
        if final.exists():
            shutil.rmtree(old)
        else:
            os.rename(old, final)
    if final.exists():
        os.rename(final, old)
    try:
        os.rename(staged, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.rename(old, final)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs (the writer of a temporary file, the owner of a run's lock); another
    user's process counts, a huge number is no process id."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid < 2**22
    return True
