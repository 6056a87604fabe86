"""Stopping and reaping the processes a Flower daemon started (the SuperLink and SuperExec launchers).

A process that exits stays a zombie (``<defunct>``) until its parent waits for it, and a process whose parent
exits first is handed to the nearest *subreaper* ancestor (Linux ``PR_SET_CHILD_SUBREAPER``), or to init.
Flower's daemons start their children in sessions of their own and do not always wait for them, so the
launchers here wait for what they started, become the subreaper of everything below them, and stop all of it
before they exit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

import psutil

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux): one whose parent exits is re-parented here, not to
    init, so that :func:`stop_processes` still finds it. False where the kernel does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reap_exited_children() -> list[int]:
    """Wait for every child of this process that has exited (without blocking); their pids."""
    reaped: list[int] = []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append(pid)


def reap_on_sigchld() -> None:
    """Reap this process's exited children as they exit. For a process whose only children are ones nobody else
    waits for (a subreaper's adopted orphans, a daemon's own helpers): it takes the exit status from anyone else who
    waits for a child (``subprocess`` then reads 0)."""
    if hasattr(signal, "SIGCHLD"):  # (POSIX; elsewhere nothing is left a zombie)
        signal.signal(signal.SIGCHLD, lambda signum, frame: reap_exited_children())


def _running(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` that still run (a zombie has ended: only its parent's wait is missing)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _wait(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while True:
        reap_exited_children()
        left = _running(procs)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def stop_processes(procs: list[psutil.Process], grace: float) -> list[psutil.Process]:
    """SIGTERM ``procs``, give them ``grace`` seconds, SIGKILL those left and wait up to 2 s more, reaping every
    exited child of this process meanwhile; the processes still running after that (none, normally).
    ``psutil.Process`` checks a process's identity (pid and start time) before signalling it, so a pid reused
    by an unrelated process after one of these exited is never signalled."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            continue
    left = _wait(procs, grace)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    return _wait(left, 2.0) if left else []


def stop_descendants(grace: float) -> list[psutil.Process]:
    """Every descendant of this process (and those adopted meanwhile) stopped: given ``grace`` seconds to end by
    themselves first (a daemon's own shutdown has signalled its children, which stop theirs: a second SIGTERM would
    cut that short, Flower resetting its handler after the first), then :func:`stop_processes`."""
    me = psutil.Process()
    left = stop_processes(_wait(me.children(recursive=True), grace), grace)
    adopted = _running(me.children(recursive=True))  # re-parented here while the others stopped
    left = [*left, *stop_processes(adopted, grace)] if adopted else left
    if not left:  # (a process still running would keep its zombies: nothing to wait for)
        _reap_remaining(me, grace)
    return left


def _reap_remaining(me: psutil.Process, seconds: float) -> None:
    """Wait until no descendant is left, not even a zombie: one whose parent ended without waiting for it is
    re-parented here (the subreaper) and reaped; exiting before that would leave it to init."""
    deadline = time.monotonic() + seconds
    while True:
        reap_exited_children()
        try:
            if not me.children(recursive=True) or time.monotonic() >= deadline:
                return
        except psutil.Error:
            return
        time.sleep(0.05)
