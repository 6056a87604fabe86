"""Run a fedpeft config on Flower's deployment engine.

``run_flower`` writes a Flower app for the config (a ``pyproject.toml`` whose components are
fedpeft's ServerApp and ClientApp and whose run config holds the resolved fedpeft config and the run
directory), then either starts a SuperLink (through :mod:`fedpeft.runtime.flower.superlink`, so its
Control and Runtime APIs answer this machine only) and ``runtime.flower.num_supernodes`` SuperNodes on
loopback (free ports, every process stopped afterwards) or uses the running SuperLink at
``runtime.flower.superlink``, and submits the app with ``flwr run --stream``. The ServerApp writes
the usual run directory; Flower's own logs go to RUN_DIR/flower/. With ``runtime.flower.engine:
simulation`` the SuperLink runs Flower's Ray simulation engine instead: the same ServerApp and
ClientApp, with ``num_supernodes`` virtual SuperNodes whose ClientApps live in Ray actors.

Every Flower process gets FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 (and the SuperLink
``--disable-runtime-dependency-installation``), so nothing is installed from the network: fedpeft
and its dependencies must already be installed wherever a SuperLink or SuperNode runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self

import psutil
import tomli_w

from fedpeft.config import ConfigError, RunConfig, dump_config
from fedpeft.errors import UserError
from fedpeft.observer import RunObserver
from fedpeft.rundir import new_run_dir, read_summary
from fedpeft.runlock import RunLock
from fedpeft.runtime.flower.credentials import partition_keys
from fedpeft.runtime.flower.fast_supernode import DEFAULT_POLL_S
from fedpeft.runtime.flower.records import CONFIG_KEY
from fedpeft.runtime.resume import resume_point

SERVER_APP = "fedpeft.runtime.flower.server_app:app"
CLIENT_APP = "fedpeft.runtime.flower.client_app:app"
CONNECTION = "fedpeft"
FLOWER_ENV = {
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    # SuperExec polls for new ServerApp/ClientApp tasks (default 1 s); every poll costs the SuperLink CPU
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
}


def flower_executable(name: str) -> str:
    """A Flower console script of the running Python's environment (flwr, flower-superlink, ...)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name!r} not found: install fedpeft with its dependencies (flwr==1.41.0) in this environment")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args[0]} exited with code {proc.returncode} before listening on {port}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


def flower_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(FLOWER_ENV)
    # the SuperLink and SuperNodes start flower-superexec / flwr-serverapp / flwr-clientapp from PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["FLWR_HOME"] = str(home)
    return env


class LocalDeployment:
    """A SuperLink and N SuperNodes on 127.0.0.1, logs in ``log_dir``.

    With ``credentials`` (a folder from :func:`fedpeft.runtime.flower.credentials.make_credentials`)
    the SuperLink serves TLS with SuperNode authentication on, every SuperNode key is registered with
    ``flwr supernode register`` and the SuperNodes connect with the CA certificate and their private key; a run
    on it whose config pins no partition (``runtime.flower.partition_keys`` None) gets partition i pinned to the
    key of SuperNode i (:meth:`pinned_keys`). The SuperLink runs through :mod:`fedpeft.runtime.flower.superlink`:
    its Control and Runtime APIs answer ``control_from`` only (its ``--control-from`` values; default: this machine).
    """

    def __init__(self, num_supernodes: int, log_dir: str | Path, *, env: dict[str, str] | None = None,
                 credentials: str | Path | None = None, warm: bool = True, simulation: bool = False,
                 supernode_poll_s: float | None = DEFAULT_POLL_S, control_from: list[str] | None = None):
        self.num_supernodes = num_supernodes
        self.control_from = list(control_from or [])
        # SuperNodes through fedpeft.runtime.flower.fast_supernode (this idle poll) or, with None, Flower's own
        self.supernode_poll_s = supernode_poll_s
        # simulation: a SuperLink with Flower's Ray simulation engine; its SuperNodes are virtual, none started
        self.simulation = simulation
        self.log_dir = Path(log_dir)
        self.credentials = Path(credentials).resolve() if credentials else None
        self.cwd = os.getcwd()
        self.warm = warm  # SuperNodes in process isolation, each with a long-lived fedpeft ClientApp worker
        self.workers: list[subprocess.Popen | None] = []
        self.env = env or flower_env(self.log_dir / "home")
        self.port = 0
        self.superlink: subprocess.Popen | None = None
        self.supernodes: list[subprocess.Popen | None] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def root_certificates(self) -> str | None:
        return str(self.credentials / "ca.crt") if self.credentials else None

    def _security(self) -> list[str]:
        c = self.credentials
        if c is None:
            return ["--insecure"]
        return ["--ssl-ca-certfile", str(c / "ca.crt"), "--ssl-certfile", str(c / "server.pem"),
                "--ssl-keyfile", str(c / "server.key"), "--enable-supernode-auth"]

    def _spawn(self, args: list[str], log_name: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / log_name, "ab")  # noqa: SIM115 (held open for the process's life)
        try:
            # started from the caller's directory, so relative paths (data, models) mean what they mean here
            return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**self.env, **(extra_env or {})},
                                    cwd=self.cwd, start_new_session=True)
        finally:
            out.close()

    def start(self, timeout: float = 120.0) -> LocalDeployment:
        try:
            return self._start(timeout)
        except BaseException:
            self.close()  # nothing started here outlives a failed start
            raise

    def _start(self, timeout: float) -> LocalDeployment:
        self.port = free_port()
        mode = ["--simulation"] if self.simulation else []
        control = [arg for net in self.control_from for arg in ("--control-from", net)]
        self.superlink = self._spawn([sys.executable, "-m", "fedpeft.runtime.flower.superlink", *control,
                                      *self._security(), *mode, "--host", "127.0.0.1", "--port", str(self.port),
                                      "--disable-runtime-dependency-installation"], "superlink.log")
        wait_for_port(self.port, timeout, self.superlink)
        if self.simulation:
            return self
        if self.credentials is not None:
            self._register_supernodes()
        self.supernodes, self.workers = [], []
        for i in range(self.num_supernodes):
            self.start_supernode(i)
        return self

    def pinned_keys(self, partitions: int) -> dict[int, str] | None:
        """With credentials, {i: the fingerprint of supernode-i.pub} for the first ``partitions`` SuperNodes: the keys
        this deployment registered and SuperNode i signs with. None without credentials (keys change at every start)."""
        if self.credentials is None or self.simulation:
            return None
        return partition_keys(self.credentials, min(partitions, self.num_supernodes))

    def _register_supernodes(self) -> None:
        home = Path(self.env["FLWR_HOME"])
        write_connection(home, self.address, self.root_certificates)
        for i in range(self.num_supernodes):
            key = self.credentials / f"supernode-{i}.pub"  # type: ignore[operator]
            out = subprocess.run([flower_executable("flwr"), "supernode", "register", str(key), CONNECTION],
                                 env=self.env, cwd=self.log_dir, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"registering {key} with the SuperLink failed: {(out.stdout + out.stderr).strip()}")

    def start_supernode(self, i: int) -> subprocess.Popen:
        if self.credentials is None:
            security = ["--insecure"]
        else:
            security = ["--root-certificates", str(self.credentials / "ca.crt"),
                        "--auth-supernode-private-key", str(self.credentials / f"supernode-{i}")]
        api_port = free_port()
        isolation = ["--isolation", "process"] if self.warm else []
        if self.supernode_poll_s is None:
            supernode = [flower_executable("flower-supernode")]
        else:
            supernode = [sys.executable, "-m", "fedpeft.runtime.flower.fast_supernode", "--poll-interval",
                         str(self.supernode_poll_s)]
        proc = self._spawn([*supernode, *security, *isolation, "--superlink",
                            self.address, "--host", "127.0.0.1", "--port", str(api_port),
                            "--node-config", f"partition-id={i} num-partitions={self.num_supernodes}"],
                           f"supernode-{i}.log", self.thread_env())
        self._record(self.supernodes, i, proc)
        if self.warm:
            wait_for_port(api_port, 60, proc)
            worker = self._spawn([sys.executable, "-m", "fedpeft.runtime.flower.warm_worker",
                                  "--runtime-api-address", f"127.0.0.1:{api_port}", "--supernode-pid", str(proc.pid)],
                                 f"worker-{i}.log", self.thread_env())
            self._record(self.workers, i, worker)
        return proc

    @staticmethod
    def _record(procs: list, i: int, proc: subprocess.Popen) -> None:
        procs.extend([None] * (i + 1 - len(procs)))
        procs[i] = proc

    @staticmethod
    def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, wait: float = 15.0) -> None:
        """Stop a Flower daemon and every process it started (Flower detaches its SuperExec and app
        processes into their own sessions, so a process-group signal alone would miss them)."""
        if proc is None or proc.poll() is not None:
            return
        try:
            parent = psutil.Process(proc.pid)
            family = [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        # psutil.Process checks a process's identity (pid and start time) before signalling it, so a pid
        # reused by an unrelated process after one of these exited is never signalled
        for p in family:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()

    def thread_env(self) -> dict[str, str]:
        """The SuperNodes' ClientApps train at the same time on one machine: each gets an equal share of
        the cores for its math libraries (oversubscribed OpenMP threads spin: training ran ~4x slower)."""
        if "OMP_NUM_THREADS" in self.env:
            return {}
        share = str(max(1, (os.cpu_count() or 1) // self.num_supernodes))
        return {"OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share}

    def kill_supernode(self, i: int) -> None:
        """SIGKILL SuperNode i, its ClientApp worker and everything they started (to test client failures)."""
        self._stop(self.supernodes[i], signal.SIGKILL)
        if i < len(self.workers):
            self._stop(self.workers[i], signal.SIGKILL)

    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink with its SuperExec and ServerApp (used to test server crashes)."""
        self._stop(self.superlink, signal.SIGKILL)

    def close(self) -> None:
        for proc in [*self.workers, *self.supernodes]:
            self._stop(proc)
        self._stop(self.superlink)

    def __enter__(self) -> Self:
        return self.start() if self.superlink is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_app(app_dir: str | Path, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False) -> Path:
    """A Flower app directory that runs ``cfg`` with fedpeft's ServerApp and ClientApp."""
    app_dir = Path(app_dir)
    app_dir.mkdir(parents=True, exist_ok=True)
    pyproject = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": "fedpeftrun", "version": "1.0.0", "description": f"fedpeft run {cfg.name}",
                    "license": "Apache-2.0", "dependencies": []},
        "tool": {"flwr": {"app": {
            "publisher": "fedpeft",
            "components": {"serverapp": SERVER_APP, "clientapp": CLIENT_APP},
            "config": {CONFIG_KEY: dump_config(cfg), "run-dir": str(Path(run_dir).resolve()), "resume": resume},
        }}},
    }
    (app_dir / "pyproject.toml").write_text(tomli_w.dumps(pyproject))
    return app_dir


def write_connection(home: Path, address: str, root_certificates: str | None) -> None:
    conn: dict[str, Any] = {"address": address}
    if root_certificates:
        conn["root-certificates"] = str(Path(root_certificates).resolve())
    else:
        conn["insecure"] = True
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": CONNECTION, CONNECTION: conn}}))


def check_partitions_pinned(cfg: RunConfig, resume: bool, log: Callable[[str], None]) -> None:
    """Refuse a new run on a SuperLink of one's own (``runtime.flower.superlink``, engine deployment) whose config
    neither pins its partitions to SuperNode keys nor says ``any``: any SuperNode of that SuperLink could claim a
    partition that belongs to another participant. A resumed run started before this rule continues as ``any``."""
    fl = cfg.runtime.flower
    if fl.superlink is None or fl.engine != "deployment" or fl.partition_keys is not None:
        return
    if resume:
        log(f"warning: runtime.flower.partition_keys: the run's config pins no partition, so any SuperNode of the "
            f"SuperLink at {fl.superlink!r} may claim a free one (as partition_keys: any)")
        return
    raise ConfigError(
        f"runtime.flower.partition_keys: without it a run on the SuperLink at superlink={fl.superlink!r} lets any "
        "SuperNode of that SuperLink claim any free partition, even one that belongs to another participant; pin each "
        "partition to its SuperNode's key, partition_keys={0: key or SHA256 fingerprint, 1: ...} (`fedpeft flower "
        "credentials` prints the setting for its keys), or set partition_keys: any to let any SuperNode claim a free "
        "partition (for a SuperLink without SuperNode authentication, whose keys change at every start)")


def pinned_to(cfg: RunConfig, deployment: LocalDeployment, log: Callable[[str], None]) -> RunConfig:
    """``cfg`` with partition i pinned to the key of ``deployment``'s SuperNode i when the deployment authenticates
    its SuperNodes (it registered their keys itself) and ``cfg`` pins nothing (``partition_keys`` None, not any)."""
    fl = cfg.runtime.flower
    pins = deployment.pinned_keys(fl.num_supernodes) if fl.partition_keys is None else None
    if not pins or fl.engine != "deployment":
        return cfg
    pinned = cfg.model_copy(deep=True)
    pinned.runtime.flower.partition_keys = pins
    log(f"partitions pinned to the keys of the SuperNodes started here: {pins}")
    return pinned


def simulation_options(cfg: RunConfig) -> list[str]:
    """``flwr run`` options for Flower's simulation engine: virtual SuperNodes and Ray resources per ClientApp."""
    fl = cfg.runtime.flower
    if fl.engine != "simulation":
        return []
    try:
        import ray  # noqa: F401
    except ImportError:
        raise RuntimeError("runtime.flower.engine: simulation needs Ray: pip install 'fedpeft[simulation]'") from None
    return ["--federation-config", f"num-supernodes={fl.num_supernodes} client-resources-num-cpus={fl.client_cpus:g}"]


def run_flower(cfg: RunConfig, run_dir: str | Path | None = None, *, resume: bool = False,
               deployment: LocalDeployment | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume, or extend to ``cfg.federation.rounds``) ``cfg`` on Flower; returns the run's summary.json.
    This process holds the run directory's lock (fedpeft.runlock) until the run ends."""
    from fedpeft import tracking

    tracking.check_available(cfg.runtime.loggers)  # here, before any SuperNode starts, not inside the ServerApp
    if deployment is None:
        check_partitions_pinned(cfg, resume, log)
    if resume:
        run_dir = Path(run_dir)  # type: ignore[arg-type]
        lock = RunLock.acquire(run_dir)
        try:
            resume_point(run_dir, cfg.federation.rounds)  # fail here, not inside the ServerApp, if it cannot go on
            # an extended run's old summary must not pass for the new one if the ServerApp fails to start
            (run_dir / "summary.json").unlink(missing_ok=True)
        except BaseException:
            lock.release()
            raise
    else:
        run_dir = new_run_dir(cfg, run_dir)
        lock = RunLock.acquire(run_dir)
    try:
        return _run_flower(cfg, Path(run_dir).resolve(), resume, deployment, log)
    finally:
        lock.release()


def launch(cfg: RunConfig, run_dir: str | Path | None, *, resume: bool, observers: Sequence[RunObserver],
           log: Callable[[str], None] | None, on_run_dir: Callable[[Path], None] | None) -> dict[str, Any]:
    """The Flower runtime's launch (``runtime.name: flower``, see :class:`fedpeft.launchers.Launch`; registered
    with in_process=False, so ``observers`` is empty): with ``on_run_dir``, a new run's directory is made before
    its SuperNodes start, so that an interrupted launch can name it. ``log``: print by default."""
    log = print if log is None else log
    if not resume and on_run_dir is not None:
        check_partitions_pinned(cfg, resume, log)  # before the run's directory is made
        run_dir = new_run_dir(cfg, run_dir)
        on_run_dir(run_dir)
    return run_flower(cfg, run_dir, resume=resume, log=log)


def _run_flower(cfg: RunConfig, run_dir: Path, resume: bool, deployment: LocalDeployment | None,
                log: Callable[[str], None]) -> dict[str, Any]:
    flower_dir = run_dir / "flower"
    work = Path(tempfile.mkdtemp(prefix="fedpeft-flower-"))
    own: LocalDeployment | None = None
    try:
        env = flower_env(work / "home")
        fl = cfg.runtime.flower
        if deployment is not None:
            address, certs = deployment.address, deployment.root_certificates
            cfg = pinned_to(cfg, deployment, log)
        elif fl.superlink is None:
            simulation = fl.engine == "simulation"
            own = LocalDeployment(fl.num_supernodes, flower_dir, env=env, warm=fl.warm_clients,
                                  simulation=simulation, supernode_poll_s=fl.supernode_poll_s).start()
            address, certs = own.address, None
            what = "simulation engine (Ray)" if simulation else f"{fl.num_supernodes} SuperNodes"
            log(f"started a SuperLink on {address} with the {what} (logs: {flower_dir})")
        else:
            address, certs = fl.superlink, fl.root_certificates
            if certs is None and not address.startswith(("127.", "localhost", "[::1]")):
                log(f"warning: no runtime.flower.root_certificates: talking to the SuperLink at {address} without "
                    "TLS, so configs and payloads cross the network unencrypted")
        write_connection(work / "home", address, certs)
        app_dir = write_app(work / "app", cfg, run_dir, resume=resume)
        flower_dir.mkdir(parents=True, exist_ok=True)
        log(f"run directory: {run_dir}")
        stream = flower_dir / "flwr-run.log"
        with open(stream, "ab") as out, progress_bar(cfg, stream):
            proc = subprocess.run([flower_executable("flwr"), "run", str(app_dir), CONNECTION, "--stream",
                                   *simulation_options(cfg)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work,
                                  check=False)  # the exit code is judged below, with the logs
    finally:
        if own is not None:
            own.close()
        shutil.rmtree(work, ignore_errors=True)
    summary = read_summary(run_dir)
    if not summary or proc.returncode != 0:
        cause = last_error(flower_dir)
        raise FlowerRunError(f"the Flower run ended (flwr exit code {proc.returncode}) without results"
                             f"{': ' + cause if cause else ''}; logs: {flower_dir}")
    return summary


@contextlib.contextmanager
def progress_bar(cfg: RunConfig, stream: Path) -> Iterator[None]:
    """The ServerApp's log, as ``flwr run --stream`` appends it to ``stream``, followed on the console: its
    warnings printed, and with runtime.progress a bar of rounds (and clients done in the round) drawn from its
    progress lines."""
    from fedpeft.runtime.progress import FileFollower

    bar = None
    if cfg.runtime.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.federation.rounds, desc=cfg.name, unit="round", dynamic_ncols=True)
    follower = FileFollower(stream, bar)
    follower.start()
    try:
        yield
    finally:
        follower.stop()
        if bar is not None:
            bar.close()


class FlowerRunError(UserError, RuntimeError):
    """A Flower run that ended without results; the message names the cause found in its logs."""


_ERROR_LINE = re.compile(r"(?:^|\s)(?:[\w.]+\.)?(\w+(?:Error|Exception|Busy)): (.+)$")


def last_error(flower_dir: Path) -> str | None:
    """The last exception line ("SomeError: message") in the run's Flower logs, flwr-run.log first."""
    logs = sorted(flower_dir.glob("*.log"), key=lambda p: p.name != "flwr-run.log")
    for path in logs:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for line in reversed(lines):
            m = _ERROR_LINE.search(line.strip())
            if m:
                return f"{m[1]}: {m[2]}"
    return None
