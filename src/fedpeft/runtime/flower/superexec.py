"""``flower-superexec`` that waits for the ServerApp processes it starts, and stops them when it stops.

Flower 1.41's SuperExec starts each ServerApp (``flwr-serverapp``, ``flwr-simulation``) with ``subprocess.Popen``
and drops the handle (``SubprocessExecutor.launch``); nothing waits for the process. So a finished ServerApp stays
a zombie (``<defunct>``), a child of the SuperExec, until the SuperExec starts the next one (CPython waits for
dropped handles only when a new ``Popen`` is made), and the ServerApps still running when the SuperExec stops are
orphaned. This runs Flower's entry point unchanged, plus:

* on SIGCHLD, the dropped handles whose process has exited are waited for (``subprocess._cleanup``, what every new
  ``Popen`` does first); a child whose handle is still held (a dependency installation the SuperExec waits for)
  is left to its holder;
* at exit (Flower's SIGTERM / SIGINT handler ends in ``sys.exit``), the children still running get SIGTERM, 3 s,
  then SIGKILL, and are waited for (fedpeft's SuperLink launcher gives its SuperExec that long before it signals
  again).

fedpeft's SuperLink launcher (:mod:`fedpeft.runtime.flower.superlink`) starts its SuperExec through this; a
SuperExec of your own (``--isolation process``) can run it in place of ``flower-superexec``:

    python -m fedpeft.runtime.flower.superexec <flower-superexec arguments>
"""

from __future__ import annotations

import atexit
import signal
import subprocess
import sys
from types import FrameType

import psutil

from fedpeft.runtime.flower.internals import run_flower_superexec
from fedpeft.runtime.flower.processes import stop_processes

STOP_GRACE_S = 3.0  # SIGTERM to SIGKILL for the ServerApps still running at exit


def wait_for_dropped_children(signum: int | None = None, frame: FrameType | None = None) -> None:
    """Wait for the children whose ``Popen`` handle was dropped while they ran and that have exited since."""
    cleanup = getattr(subprocess, "_cleanup", None)  # CPython's list of dropped handles, polled by each new Popen
    if cleanup is not None:
        cleanup()


def stop_children() -> None:
    """Stop and wait for this process's children that still run."""
    stop_processes(psutil.Process().children(), STOP_GRACE_S)


def main(argv: list[str] | None = None) -> None:
    if hasattr(signal, "SIGCHLD"):  # (POSIX; elsewhere nothing is left a zombie)
        signal.signal(signal.SIGCHLD, wait_for_dropped_children)
    atexit.register(stop_children)
    sys.argv = ["flower-superexec", *(sys.argv[1:] if argv is None else argv)]
    run_flower_superexec()


if __name__ == "__main__":
    main()
