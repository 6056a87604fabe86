"""One writer per run directory.

A process that writes a run directory (a new run, a resumed one, an extended one) holds an exclusive
lock on ``RUN_DIR/.fedpeft.lock`` (``filelock``: ``flock`` on POSIX, ``msvcrt`` locking on Windows) for as
long as it writes. The operating system drops the lock when the process ends, however it ends, so a crash
never leaves the directory locked. Next to the lock, ``RUN_DIR/.fedpeft.owner.json`` names the writer
(process id, host, start time) for the message a second writer gets; it is removed on a clean release,
so finding it on a directory whose lock is free means the last writer died without releasing: that stale
lock is taken over and logged.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from fedpeft.durable import atomic_write, is_refused_write, pid_alive, refused_write

LOCK_FILE = ".fedpeft.lock"
OWNER_FILE = ".fedpeft.owner.json"
log = logging.getLogger("fedpeft")


class RunDirectoryBusy(FileExistsError):
    """Another live process is writing this run directory."""


def _owner(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _describe(owner: dict[str, Any] | None) -> str:
    if not owner:
        return "another process"
    return f"process {owner.get('pid')} on {owner.get('host')} (since {owner.get('started')})"


def writer_alive(run_dir: str | Path) -> bool:
    """Whether a live process holds ``run_dir``'s lock: a run without summary.json is running when this holds, else
    it stopped before its end. The lock is tried and at once given back (the operating system drops a dead writer's
    lock, so a stale owner file or a reused process id does not count); where it cannot be tried (a read-only
    directory), the owner file's process on this host is looked for."""
    path = Path(run_dir) / LOCK_FILE
    if path.is_file():
        probe = FileLock(str(path), timeout=0)
        try:
            probe.acquire()
        except Timeout:
            return True
        except OSError:
            pass
        else:
            probe.release()
            return False
    owner = _owner(Path(run_dir))
    if not owner or owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    return pid_alive(owner["pid"])


class RunLock:
    """The exclusive lock of one run directory; :meth:`release` (or the process's end) gives it up."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._lock = FileLock(str(self.run_dir / LOCK_FILE), timeout=0)

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunLock:
        """Lock ``run_dir`` (which must exist) or raise :class:`RunDirectoryBusy` at once, naming the writer."""
        lock = cls(run_dir)
        try:
            lock._lock.acquire()
        except Timeout:
            raise RunDirectoryBusy(
                f"run directory {str(lock.run_dir)!r} is being written by {_describe(_owner(lock.run_dir))}; wait "
                "for it to end (or stop it) before resuming, or choose another --run-dir"
            ) from None
        except OSError as exc:  # a read-only or full disk: one line, not a traceback
            if is_refused_write(exc):
                raise refused_write(lock.run_dir / LOCK_FILE, exc, then="try again") from None
            raise
        stale = _owner(lock.run_dir)
        if stale is not None:
            log.warning("run directory %s: took over the lock of %s, which ended without releasing it (crash or kill)",
                        lock.run_dir, _describe(stale))
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            atomic_write(lock.run_dir / OWNER_FILE, json.dumps(owner).encode("utf-8"))
        except BaseException:
            lock._lock.release()
            raise
        return lock

    def close_in_child(self) -> None:
        """In a process forked from the lock's holder: close this process's copies of the lock file's descriptor,
        without unlocking. A flock lasts while any descriptor of it is open, so a forked worker that kept its copy
        would hold the run directory after the run's process died, and a resume right after a kill -9 would find it
        busy. (Linux: the descriptors are found in /proc/self/fd; elsewhere nothing is closed.)"""
        target = os.path.realpath(self.run_dir / LOCK_FILE)
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return
        for name in names:
            try:
                if os.readlink(f"/proc/self/fd/{name}") == target:
                    os.close(int(name))
            except OSError:
                pass

    def release(self) -> None:
        if not self._lock.is_locked:
            return
        try:
            (self.run_dir / OWNER_FILE).unlink()
        except FileNotFoundError:
            pass
        self._lock.release()
