"""fedpeft's SuperLink launcher as a daemon, on real Flower processes over loopback: a finished ServerApp is not left
a zombie, SIGTERM (like SIGINT) stops the SuperLink within seconds even while a run streams its logs, with nothing it
started left behind, and a --control-from that would refuse its own SuperExec is named at startup. The runs here are
Flower apps of the tests' own (no model), so each costs seconds."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import write_flower_app

from fedpeft.runtime.flower.launch import (
    LocalDeployment,
    flower_env,
    flower_executable,
    free_port,
    write_connection,
)

SERVER = '''
import time
from pathlib import Path
from flwr.serverapp import ServerApp

app = ServerApp()


@app.main()
def main(grid, context):
    Path(context.run_config["marker"]).write_text("running")
    time.sleep(float(context.run_config["seconds"]))
'''
CONTROL_FROM_WARNING = "--control-from does not admit"


def start_app(dep: LocalDeployment, folder: Path, seconds: float) -> tuple[subprocess.Popen, Path]:
    """``flwr run --stream`` of a ServerApp that writes its marker file and sleeps ``seconds``; the marker's path."""
    marker = folder / "marker"
    app = write_flower_app(folder / "app", "sleeper", {"server": SERVER}, serverapp="server:app",
                           clientapp="server:app", config={"marker": str(marker), "seconds": str(seconds)})
    write_connection(Path(dep.env["FLWR_HOME"]), dep.address, None)
    out = open(folder / "flwr-run.log", "ab")  # noqa: SIM115 (held by the process)
    try:
        run = subprocess.Popen([flower_executable("flwr"), "run", str(app), "fedpeft", "--stream"], env=dep.env,
                               stdout=out, stderr=subprocess.STDOUT, cwd=folder)
    finally:
        out.close()
    return run, marker


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {seconds:.0f} s"
        time.sleep(0.1)


def family(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def named(procs: list[psutil.Process], word: str) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if any(word in part for part in p.cmdline()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out


def zombies(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def test_a_finished_serverapp_is_not_left_a_zombie(tmp_path):
    """Flower's SuperExec drops the handle of every ServerApp process it starts; fedpeft's waits for it. The SuperLink
    started with the default --control-from does not warn about its own SuperExec."""
    with LocalDeployment(0, tmp_path / "logs") as dep:
        run, marker = start_app(dep, tmp_path, seconds=0)
        assert run.wait(timeout=120) == 0, (tmp_path / "flwr-run.log").read_text()
        assert marker.exists()
        # a ServerApp that has ended may be a zombie for a moment (its parent's SIGCHLD handler reaps it); one left
        # a zombie for 10 s is one nobody waits for (Flower's own SuperExec: until the next run starts)
        wait_until(lambda: not named(family(dep.superlink.pid), "flwr-serverapp")
                   and not zombies(family(dep.superlink.pid)), 10, "ServerApp ended and reaped")
        assert named(family(dep.superlink.pid), "fedpeft.runtime.flower.superexec")  # the SuperExec that reaps
    assert CONTROL_FROM_WARNING not in (tmp_path / "logs" / "superlink.log").read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_superlink_mid_run_with_everything_it_started(tmp_path, signum):
    """Mid-run, `flwr run --stream` holds a log stream open, which Flower's uvicorn would wait for until the run ends.
    One SIGTERM or SIGINT to the launcher alone stops it within 10 s, exit status 0, with its SuperExec and ServerApp."""
    dep = LocalDeployment(0, tmp_path / "logs").start()
    run = None
    try:
        run, marker = start_app(dep, tmp_path, seconds=600)
        wait_until(marker.exists, 120, "ServerApp")
        started = family(dep.superlink.pid)
        assert named(started, "flwr-serverapp") and named(started, "fedpeft.runtime.flower.superexec")
        t0 = time.monotonic()
        dep.superlink.send_signal(signum)
        code = dep.superlink.wait(timeout=10)
        took = time.monotonic() - t0
        left = [p for p in started[1:] if p.is_running() and p not in zombies([p])]
        assert code == 0 and not left, (code, [p.pid for p in left])
        assert not [p for p in started[1:] if p.is_running()]  # not even a zombie
        print(f"{signal.Signals(signum).name}: the SuperLink stopped in {took:.1f} s")
    finally:
        if run is not None:
            LocalDeployment._stop(run)
        dep.close()


def test_a_control_from_that_refuses_the_superlinks_own_superexec_is_named_at_startup(tmp_path):
    """--host :: makes Flower's SuperExec dial the Runtime API at [::1], which --control-from 127.0.0.1/32 refuses."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    log = tmp_path / "superlink.log"
    with open(log, "wb") as out:
        superlink = subprocess.Popen([sys.executable, "-m", "fedpeft.runtime.flower.superlink", "--control-from",
                                      "127.0.0.1/32", "--insecure", "--host", "::", "--port", str(free_port()),
                                      "--disable-runtime-dependency-installation"],
                                     env=flower_env(tmp_path / "home"), stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
    try:
        wait_until(lambda: CONTROL_FROM_WARNING in log.read_text(), 60, "warning")
        superlink.send_signal(signal.SIGTERM)
        assert superlink.wait(timeout=10) == 0
    finally:
        LocalDeployment._stop(superlink)
    warnings = [line for line in log.read_text().splitlines() if CONTROL_FROM_WARNING in line]
    assert len(warnings) == 1
    assert ("--control-from does not admit ::1, the address this SuperLink's own SuperExec and ServerApps connect "
            "from") in warnings[0] and "add --control-from local (or --control-from ::1)" in warnings[0]
