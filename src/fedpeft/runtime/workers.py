"""A round's clients on several worker processes of this machine (``runtime.workers``), over one frozen backbone.

The workers are forked from the run's process once the experiment is built (model, data, PEFT method), when the run
starts (with ``auto``, once the first round's probe has measured their number), and live until it ends. A fork shares the parent's memory copy-on-write: the frozen backbone's weights are
never written, so every worker reads the one copy the parent loaded; only what a worker writes (the trainable
tensors, activations, optimizer state) becomes its own. Each worker runs with ``runtime.threads`` (or the host's
cores) divided among the workers as torch threads.

A round's clients are split into contiguous shares, one per worker; each worker trains its share as the in-process
transport does (one after another, or ``clients_per_pass`` at a time in fused passes) and sends back each client's
result, its algorithm state (the parent keeps every client's state, and checkpoints it) and what its client half
reported to the run's observers (replayed here in client order). A client's update depends only on (seed, round,
client) and its payload and state, so which worker trains it changes nothing beyond float32 rounding (the
workers' torch threads reduce in another order).

A worker that dies (killed, out of memory) or does not answer within ``runtime.worker_timeout_s`` (it is killed)
fails the clients of its share for that round, with the reason, and a new worker is forked before the next round.
Workers ask the kernel to kill them when the run's process dies (PR_SET_PDEATHSIG), so none outlives a killed run.

``workers: auto`` (and ``clients_per_pass: auto`` with workers) is measured on the first round's clients: for each
candidate number of workers (the divisors of the threads, fewest first), that many probe processes are forked and
time, started together (a barrier) and each with its share of the threads, the first local step of their share of
the clients (with clients_per_pass auto: Cohort.probe, which picks the clients per pass; else that number of
clients per pass, or one client at a time). A probe that has its figure trains on until every probe has one, so
that each is timed under the same load. The number whose processes together train the most examples a second
wins; the search stops at a number under 80% as fast as the best, or one whose probes did not all answer (out of
memory). The choice is kept in the checkpoint with the device type and threads it was measured for; a run resumed
with others measures again.

On a CPU the workers are forked, not spawned: a spawned worker would rebuild the experiment (the model load, the
tokenisation) and hold its own copy of the backbone, where a fork after the build shares the parent's for free.
CUDA cannot be forked into, so on CUDA the workers are spawned (PyTorch's guidance for CUDA in subprocesses), one
per device unless ``runtime.workers`` says otherwise (worker i on device i modulo the devices; ``auto``: one per
device, with clients_per_pass auto measured by the run's process on its own device). A spawned worker is told its
device (``CUDA_VISIBLE_DEVICES``) before torch starts CUDA, rebuilds the experiment from the run's config (the
installed plugins, and of those the config lists the ones the run's process loaded; plugins registered only in the
run's process are not there), reports ready, and then serves rounds exactly as a forked worker does. Tests spawn
workers on a CPU (``WorkerPoolTransport(n, start="spawn")``) to check them against one process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedpeft import wire
from fedpeft.algorithms import runtime_needs
from fedpeft.config import ConfigError
from fedpeft.data.batching import collate
from fedpeft.runtime.cohort import pass_row
from fedpeft.runtime.inprocess import InProcessTransport
from fedpeft.runtime.outcome import ClientResult
from fedpeft.training.fused import PassStats
from fedpeft.training.local import plan_batches, step_groups

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from fedpeft.runtime.embedded import EmbeddedRuntime

log = logging.getLogger("fedpeft")

PR_SET_PDEATHSIG = 1
M_MMAP_THRESHOLD = -3  # (glibc's mallopt parameter)
WORKER_MMAP_THRESHOLD = 1 << 20  # bytes: a worker's allocations from this size up are mapped, and unmapped when freed


class _Reports:
    """An observer stand-in in a worker: it keeps what the client halves report, for the parent to replay."""

    def __init__(self) -> None:
        self.kept: list[tuple[int, int, str, Any]] = []

    def on_client_report(self, rnd: int, client_id: int, name: str, value: Any) -> None:
        self.kept.append((rnd, client_id, name, value))


class _Silent:
    """The progress of a worker: the parent reports each share's clients (a worker writes to no bar or log)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # (not Linux: the worker ends when its pipe closes)
        pass


def _return_large_frees() -> None:
    """Make this process's C allocator give a freed block of ``WORKER_MMAP_THRESHOLD`` bytes or more back to the
    system at once (glibc's mallopt(M_MMAP_THRESHOLD), which also stops glibc from raising that threshold as
    large blocks are freed). Otherwise the tensors of a pass are freed into the allocator's heap and kept there,
    fragmented by the next pass's other sizes: measured on MiniLM-L6, a worker's peak memory held several hundred
    MiB of free blocks, and two workers 1.5-1.6x one process's; with it, 1.2x (docs/benchmarks/workers.md). A
    threshold the user set (GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...) is kept; not glibc: nothing to do."""
    if "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


def _on_a_new_thread(target: Callable[..., None], *args: Any) -> None:
    """Run ``target`` in a forked process on a thread of its own. GNU OpenMP (torch's CPU threads) keeps a team of
    threads per thread that ran a parallel region; in a process forked from it, that thread's team refers to
    threads that were not copied, and its next parallel region with more than one thread waits for them forever.
    A new thread starts a new team."""
    thread = threading.Thread(target=target, args=args, name="fedpeft-worker")
    thread.start()
    thread.join()


def _private_mb() -> float | None:
    """This process's private memory (what it does not share with the run's process), from
    /proc/self/smaps_rollup; None where there is none."""
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    kb = sum(int(line.split()[1]) for line in lines if line.startswith(("Private_Clean:", "Private_Dirty:")))
    return kb / 1024.0


def _enter_child(transport: WorkerPoolTransport | None, parent: int) -> None:
    """The start of a worker or probe: it dies with the run's process (and ends at once if that died already),
    leaves Ctrl-C to it, returns large freed blocks to the system, and (forked) gives up its copy of the run
    directory lock's descriptor."""
    _die_with_parent()
    if os.getppid() != parent:  # (the parent died before the request above took effect)
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _return_large_frees()
    if transport is not None and transport.run.lock is not None:
        transport.run.lock.close_in_child()


def _serve(conn: Connection, transport: WorkerPoolTransport, threads: int, parent: int) -> None:
    """A worker's loop: (round, payloads, states) in, (results, states, reports, pass figures, the cohort's
    out-of-memory limit, peak RSS) out; None ends it."""
    _enter_child(transport, parent)
    _on_a_new_thread(_work, conn, transport, threads)
    conn.close()
    os._exit(0)  # (no atexit of the parent's: its files and locks are the parent's)


@dataclasses.dataclass
class _SpawnedRun:
    """What a client's training reads of its run (InProcessTransport.run_client), rebuilt in a spawned worker."""

    cfg: Any
    exp: Any
    client: Any
    max_payload: int
    client_states: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    observers: list[Any] = dataclasses.field(default_factory=list)
    progress: Any = dataclasses.field(default_factory=_Silent)
    lock: None = None


def _serve_spawned(conn: Connection, spec: dict[str, Any], threads: int, parent: int) -> None:
    """A spawned worker (see the module's text; its CUDA_VISIBLE_DEVICES came with its environment): the experiment
    rebuilt from the run's config, ("ready", its device) or ("error", why) sent, then the rounds as a forked worker
    serves them."""
    _enter_child(None, parent)
    try:
        from fedpeft import algorithms
        from fedpeft.config.load import validate_config
        from fedpeft.runtime.setup import build_experiment

        cfg = validate_config({**spec["config"], "plugins": spec["plugins"]}, trust_plugins=True, quiet=True)
        run = _SpawnedRun(cfg, build_experiment(cfg), algorithms.make_client(cfg.algorithm), spec["max_payload"],
                          observers=[_Reports()] if spec["reports"] else [])
        transport = InProcessTransport()
        transport.bind(run, None)  # type: ignore[arg-type]
        device = run.exp.device
        if device.type == "cuda":
            name = f"{torch.cuda.get_device_name(device)} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
        else:
            name = device.type
        conn.send(("ready", name))
    except BaseException:  # noqa: BLE001 (the run's process raises it)
        conn.send(("error", f"the worker could not build the experiment:\n{traceback.format_exc()}"))
        conn.close()
        os._exit(1)
    _on_a_new_thread(_work, conn, transport, threads)
    conn.close()
    os._exit(0)


def _work(conn: Connection, transport: InProcessTransport, threads: int) -> None:
    try:
        _train_shares(conn, transport, threads)
    except BaseException:  # noqa: BLE001 (outside a client's training, e.g. an answer that cannot be sent)
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass


def _train_shares(conn: Connection, transport: InProcessTransport, threads: int) -> None:
    torch.set_num_threads(threads)
    run = transport.run
    reports = _Reports()
    run.progress = _Silent()
    run.exp.trainer.on_step = None
    wants_reports = bool(run.observers)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        if request is None:
            break
        rnd, payloads, states, per_pass = request
        run.client_states = dict(states)
        if run.exp.device.type == "cuda":  # (worker_accelerator_mb: this request's peak)
            torch.cuda.reset_peak_memory_stats(run.exp.device)
        if per_pass is not None and transport.cohort is not None:  # (the run's: auto's number, a halving)
            transport.cohort.chosen, transport.cohort.limit = per_pass
        reports.kept = []
        run.observers = [reports] if wants_reports else []
        cohort = transport.cohort
        before = dataclasses.replace(cohort.stats) if cohort is not None else None
        try:
            results = InProcessTransport.run_clients(transport, rnd, payloads)
        except Exception:  # noqa: BLE001 (a client half's error: the run's process raises it, as without workers)
            conn.send(("error", traceback.format_exc()))
            continue
        passes = None
        if cohort is not None and before is not None:
            passes = cohort.stats - before
        device = run.exp.device
        accelerator = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
        conn.send((results, {cid: run.client_states.get(cid, {}) for cid in payloads}, reports.kept,
                   transport.round_info().get("clients_per_pass"), passes, cohort.limit if cohort else None,
                   _private_mb(), accelerator))


def _plain_rate(run: EmbeddedRuntime, cids: list[int]) -> float:
    """Examples a second of one client at a time: the forward and backward of the first local step of each of up to
    four of ``cids`` (the faster of two each; the gradients thrown away)."""
    exp, trainer = run.exp, run.exp.trainer
    model = exp.tuned.module
    model.train()
    examples, seconds = 0, 0.0
    autocast = trainer._autocast  # (the precision the clients train in)
    for cid in cids[:4]:
        data = exp.client_data(cid)
        if not len(data):
            continue
        group = step_groups(plan_batches(data, trainer.cfg, np.random.default_rng([run.cfg.seed, 0, cid])),
                            trainer.cfg)[0][0]
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            for idx in group:
                batch = {k: v.to(exp.device) for k, v in collate(data, idx, trainer.pad_id).items()}
                with autocast():
                    loss = model(**batch).loss
                loss.backward()
            best = min(best, time.perf_counter() - start)
            for param in exp.tuned.params.values():
                param.grad = None
        examples, seconds = examples + sum(len(idx) for idx in group), seconds + best
    return examples / seconds if seconds else 0.0


def _probe(conn: Connection, transport: WorkerPoolTransport, share: list[int], threads: int, parent: int,
           only: int | None, start: Any) -> None:
    """A probe process of ``workers: auto``: (clients per pass, examples a second) of its share's first local step
    (see the module's text); it is thrown away, so what it changes is nobody's."""
    _enter_child(transport, parent)
    log.setLevel(logging.WARNING)  # (the run's process logs the choice, once)
    _on_a_new_thread(_time_share, conn, transport, share, threads, only, start)
    conn.close()
    os._exit(0)


def _time_share(conn: Connection, transport: WorkerPoolTransport, share: list[int], threads: int,
                only: int | None, start: Any) -> None:
    try:
        torch.set_num_threads(threads)
        run, cohort = transport.run, transport.cohort
        start.wait(timeout=600)  # (every probe of this candidate times at the same time)
        k, rate = 1, 0.0
        if cohort is not None:
            k = cohort.probe(run.exp.client_data, share, run.cfg.seed, only=only)
            rate = cohort.probe_rate
            if rate == 0.0 and not isinstance(cohort._row_modules(cohort.tuned), str):
                raise MemoryError(f"out of memory at the first pass the probe tried ({only or 1} clients)")
        plain = rate == 0.0  # (no cohort, or the model cannot train clients together)
        if plain:
            k, rate = 1, _plain_rate(run, share)
        conn.send((k, rate))
    except Exception:  # noqa: BLE001 (the run's process raises it)
        start.abort()  # (the other probes stop waiting for this one)
        conn.send(("error", traceback.format_exc()))
        return
    try:  # the same work again until the run's process has every answer and kills this probe: a probe whose
        while True:  # search ended first must not leave the others the whole machine (their figures would rise)
            if plain or cohort is None:
                _plain_rate(run, share)
            else:
                cohort.probe(run.exp.client_data, share, run.cfg.seed, only=k)
    except Exception:  # noqa: BLE001 (e.g. out of memory: this probe's figure is sent already)
        return


def _even(cids: list[Any], n: int) -> list[list[Any]]:
    """``cids`` cut into ``n`` contiguous shares as even as they allow."""
    bounds = [round(j * len(cids) / n) for j in range(n + 1)]
    return [cids[bounds[j]:bounds[j + 1]] for j in range(n)]


class WorkerPoolTransport(InProcessTransport):
    """The clients of a round on ``runtime.workers`` forked worker processes (see the module's text)."""

    def __init__(self, workers: int | Literal["auto"], *, start: Literal["fork", "spawn"] | None = None) -> None:
        """``start``: how the workers start (default: fork on a CPU, spawn on CUDA, which cannot be forked
        into); spawn on a CPU rebuilds the experiment in each worker, as on CUDA (for tests)."""
        super().__init__()
        self.configured = workers
        self.start_method = start
        self.workers: int | None = None if workers == "auto" else int(workers)  # (auto: once measured)
        self.procs: list[BaseProcess | None] = []
        self.conns: list[Connection | None] = []
        self.settled = False  # the probe ran (workers or clients_per_pass auto), in this run or the checkpoint's
        self.building: set[int] = set()  # spawned workers not yet ready (still building the experiment)
        self.devices: dict[int, str] = {}  # spawned worker -> the device it reported

    def bind(self, run: EmbeddedRuntime, checkpoint: dict[str, Any] | None) -> None:
        device = run.exp.device.type
        if self.start_method is None:
            self.start_method = "fork" if device == "cpu" else "spawn"
        if self.start_method == "fork" and device != "cpu":
            raise ConfigError(f"runtime.workers {self.configured}: the run trains on {device}, which cannot be "
                              "forked into; spawn the workers (the default there)")
        if self.start_method == "spawn" and getattr(run, "experiment_given", False):
            raise ConfigError(f"runtime.workers {self.configured} on {device}: spawned workers build the experiment "
                              "from the run's config, not the one passed as experiment=; leave it out or set "
                              "runtime.workers: 1")
        if runtime_needs(run.cfg.algorithm).server_model:
            raise ConfigError(f"runtime.workers {self.configured} with algorithm {run.cfg.algorithm.name}: an "
                              "algorithm that trains a model on the server gives its client halves state built in "
                              "their own process, which the workers do not share yet; set runtime.workers: 1")
        super().bind(run, checkpoint)
        self.total_threads = run.cfg.runtime.threads or torch.get_num_threads()
        if self.start_method == "spawn" and self.configured == "auto":
            if device != "cuda":
                raise ConfigError("runtime.workers auto with spawned workers on a CPU: give their number (auto "
                                  "measures forked workers on a CPU, and is one worker per device on CUDA)")
            self.workers = torch.cuda.device_count()
        kept = (checkpoint or {}).get("workers")
        if kept is None:
            return
        if self.start_method == "spawn":  # (the number given, or this machine's devices; auto's clients per pass)
            self.settled = kept["settled"] and kept.get("device") == device
            if not self.settled and self.cohort is not None and run.cfg.runtime.clients_per_pass == "auto":
                self.cohort.chosen = None  # (measured on another device: measured again)
        elif (kept["threads"], kept.get("device")) == (self.total_threads, device):  # (trains as before)
            self.workers, self.settled = kept["workers"], kept["settled"]
        elif kept["settled"]:
            log.info("runtime.workers %s: measured for %d threads on %s, and this run has %d on %s: measured again",
                     self.configured, kept["threads"], kept.get("device"), self.total_threads, device)

    def state(self) -> dict[str, Any]:
        """What auto measured, and the fused passes' (see InProcessTransport.state)."""
        return {**super().state(), "workers": {"workers": self.workers, "settled": self.settled,
                                               "threads": self.total_threads, "device": self.run.exp.device.type}}

    @property
    def threads(self) -> int:
        """Each worker's torch threads (on CUDA, its CPU threads)."""
        return max(1, self.total_threads // (self.workers or 1))

    def start(self) -> None:
        """Start the workers once their number is known (spawned ones at once: they build the experiment while
        the run's process measures clients_per_pass auto)."""
        if self.workers is not None and self.workers > 1 and (self.ready() or self.start_method == "spawn"):
            for i in range(self.workers):
                self._fork(i)

    def ready(self) -> bool:
        """Whether the workers' numbers are known (no probe to run first)."""
        return self.settled or (self.workers is not None and self.run.cfg.runtime.clients_per_pass != "auto")

    def _fork(self, i: int) -> None:
        while len(self.procs) <= i:
            self.procs.append(None)
            self.conns.append(None)
        if self.start_method == "spawn":
            from fedpeft.plugins import is_loaded

            run = self.run
            spec = {"config": run.cfg.model_dump(mode="json"), "max_payload": run.max_payload,
                    "reports": bool(run.observers),
                    "plugins": [p for p in run.cfg.plugins if is_loaded(p)]}  # (what this process trusted)
            gpu = self._device_of(i)
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            if gpu is not None:  # (in the worker's environment from its start, before anything there sees CUDA)
                os.environ["CUDA_VISIBLE_DEVICES"] = gpu
            try:
                self.procs[i], self.conns[i] = self._spawn(_serve_spawned, (spec, self.threads, os.getpid()),
                                                           f"fedpeft-worker-{i}", "spawn")
            finally:
                if gpu is not None:
                    if before is None:
                        del os.environ["CUDA_VISIBLE_DEVICES"]
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = before
            self.building.add(i)
            return
        self.procs[i], self.conns[i] = self._spawn(_serve, (self, self.threads, os.getpid()), f"fedpeft-worker-{i}")

    def _device_of(self, i: int) -> str | None:
        """Worker ``i``'s CUDA device (as CUDA_VISIBLE_DEVICES names it; i modulo the devices); None on a CPU."""
        if self.run.exp.device.type != "cuda":
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",")] if visible else [str(d) for d in range(torch.cuda.device_count())]
        return ids[i % len(ids)]

    def _spawn(self, target: Callable[..., None], args: tuple[Any, ...], name: str,
               start: Literal["fork", "spawn"] = "fork") -> tuple[BaseProcess, Connection]:
        ctx = multiprocessing.get_context(start)
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=target, args=(theirs, *args), daemon=True, name=name)
        gc.freeze()  # (the run's objects out of the child's collections, which would write to every one's header and
        try:         # so copy every page of them; Python's own advice for a fork without exec)
            proc.start()
        finally:
            gc.unfreeze()
        theirs.close()
        return proc, mine

    def measure(self, cids: list[int]) -> None:
        """``workers`` and/or ``clients_per_pass`` auto, measured on ``cids`` (see the module's text)."""
        per_pass = self.run.cfg.runtime.clients_per_pass
        if self.start_method == "spawn":  # (workers: a number, or one per device): clients_per_pass auto, here
            self._await_built()  # (not while a worker builds on this process's device)
            self._measure_per_pass_here(cids)
            return
        only = None if per_pass == "auto" else int(per_pass)
        total = self.total_threads
        candidates = [self.workers] if self.workers is not None else [w for w in range(1, total + 1) if total % w == 0]
        found: dict[int, tuple[int, float]] = {}
        ctx = multiprocessing.get_context("fork")
        for w in candidates:
            if w > len(cids) and found:
                break
            shares = [share for share in _even(cids, min(w, len(cids))) if share]
            start = ctx.Barrier(len(shares))
            probes = [self._spawn(_probe, (self, share, max(1, total // w), os.getpid(), only, start),
                                  f"fedpeft-probe-{j}") for j, share in enumerate(shares)]
            deadline = time.monotonic() + (self.run.cfg.runtime.worker_timeout_s or float("inf"))
            try:
                answers = self._probe_answers(probes, start, deadline, w)
            finally:
                for proc, conn in probes:
                    conn.close()
                    if proc.is_alive():
                        proc.kill()
                    proc.join()
            errors = [a[1] for a in answers if a[0] == "error"]
            if errors and not found:
                raise RuntimeError(f"the probe of runtime.workers {w} failed:\n" + "\n".join(errors))
            if errors:  # (out of memory, most likely: more workers than this machine holds)
                log.warning("runtime.workers %s: the probe of %d workers failed, so no more are tried: %s",
                            self.configured, w, "; ".join(e.strip().splitlines()[-1] for e in errors))
                break
            ks = Counter(k for k, _ in answers)
            k = min(ks, key=lambda x: (-ks[x], x))  # (the processes' most frequent choice; the smaller on a tie)
            found[w] = (k, sum(rate for _, rate in answers))
            if found[w][1] < 0.8 * max(rate for _, rate in found.values()):
                break
        self.workers = max(found, key=lambda w: found[w][1])
        k = found[self.workers][0]
        if per_pass == "auto" and self.cohort is not None:
            self.cohort.chosen = k
        self.settled = True
        log.info("runtime.workers %s measured %d workers x %s clients per pass (probe of one local step, examples a "
                 "second of all the workers together: %s)", self.configured, self.workers, k,
                 ", ".join(f"{w} x {kw}: {rate:.1f}" for w, (kw, rate) in found.items()))

    def _measure_per_pass_here(self, cids: list[int]) -> None:
        """Spawned workers: clients_per_pass auto measured by the run's process, on its device (each worker's is
        another of the same kind), on the share of ``cids`` that one worker trains."""
        share = _even(cids, min(self.workers or 1, len(cids)))[0]
        if self.cohort is not None and self.cohort.chosen is None:
            self.cohort.chosen = self.cohort.probe(self.run.exp.client_data, share, self.run.cfg.seed)
        self.settled = True
        log.info("runtime.workers %s: %d workers x %s clients per pass (measured by the run's process on a share of "
                 "%d clients)", self.configured, self.workers, self.cohort.chosen if self.cohort else 1, len(share))

    def _await_built(self) -> None:
        """Wait for every spawned worker still building (no time limit: a large model may take long to load); a
        build that failed stops the run with its traceback (the config or the machine is at fault, and every
        worker would fail alike), a worker that died while building is spawned again once. Each worker's clock of
        runtime.worker_timeout_s starts with its first request, after this."""
        for i in sorted(self.building):
            answer = None
            for attempt in (1, 2):  # (a worker that died while building is spawned again, once)
                proc, conn = self.procs[i], self.conns[i]
                assert conn is not None
                try:
                    answer = self._wait(proc, conn, float("inf"), f"worker {i}")
                    break
                except EOFError:
                    code = proc.exitcode if proc is not None else None
                    if attempt == 2:
                        raise RuntimeError(f"runtime.workers: worker {i} died twice while building the experiment "
                                           f"(exit code {code}); out of memory, most likely") from None
                    log.warning("runtime.workers: worker %d died while building the experiment (exit code %s); "
                                "starting it again", i, code)
                    if proc is not None:
                        proc.join()
                    conn.close()
                    self._fork(i)
            assert answer is not None
            if answer[0] == "error":
                raise RuntimeError(f"runtime.workers: worker {i}: {answer[1]}")
            self.devices[i] = answer[1]
            self.building.discard(i)
            if len(self.devices) == (self.workers or 1):
                log.info("runtime.workers %s: %s", self.configured, ", ".join(
                    f"worker {j} on {name}" for j, name in sorted(self.devices.items())))

    def _probe_answers(self, probes: list[tuple[BaseProcess, Connection]], start: Any, deadline: float,
                       w: int) -> list[Any]:
        """Every probe's answer, or ("error", why) for one that died or passed ``deadline``. The first to die
        breaks the barrier, so that the others stop waiting for it and answer at once."""
        answers: dict[int, Any] = {}
        while len(answers) < len(probes):
            waiting = [j for j in range(len(probes)) if j not in answers]
            multiprocessing.connection.wait([probes[j][1] for j in waiting],
                                            timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            for j in waiting:
                proc, conn = probes[j]
                try:
                    if conn.poll():
                        answers[j] = conn.recv()
                        continue
                except (EOFError, OSError):
                    pass
                else:
                    if proc.is_alive():
                        if time.monotonic() < deadline:
                            continue
                        limit = self.run.cfg.runtime.worker_timeout_s
                        why = f"the probe {j} of {w} workers did not answer within runtime.worker_timeout_s {limit:g} s"
                        answers[j] = ("error", why)
                        start.abort()
                        continue
                answers[j] = ("error", f"the probe {j} of {w} workers died")
                start.abort()
        return [answers[j] for j in range(len(probes))]

    def close(self) -> None:
        """Stop the workers (the end of a run; safe to call twice)."""
        for i, (proc, conn) in enumerate(zip(self.procs, self.conns)):
            if conn is not None:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
                conn.close()
            if proc is not None:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            self.procs[i], self.conns[i] = None, None
        self.building.clear()

    def run_clients(self, rnd: int, payloads: dict[int, wire.Payload]) -> dict[int, ClientResult]:
        """Every client's result: the round's clients in ``workers`` contiguous shares, trained at once."""
        run = self.run
        cids = list(payloads)
        if not cids:
            return {}
        if not self.ready():
            self.measure(cids)
        if self.workers == 1:  # (auto measured no gain): in this process
            out = InProcessTransport.run_clients(self, rnd, payloads)
            self.pass_info["workers"] = 1
            return out
        shares = self._shares(cids)
        for i in range(len(shares)):
            proc = self.procs[i] if i < len(self.procs) else None
            if proc is None or (not proc.is_alive() and i not in self.building):  # (a building one: _await_built)
                if proc is not None:  # (it died after its last answer: its pipe and process are let go)
                    proc.join()
                    self.conns[i].close()  # type: ignore[union-attr]
                self._fork(i)
        self._await_built()
        sent: list[int] = []
        for i, share in enumerate(shares):
            run.progress.clients_training(share)
            conn = self.conns[i]
            assert conn is not None
            try:
                conn.send((rnd, {c: payloads[c] for c in share}, {c: run.client_states.get(c, {}) for c in share},
                           (self.cohort.chosen, self.cohort.limit) if self.cohort is not None else None))
                sent.append(i)
            except (BrokenPipeError, OSError):
                pass
        out: dict[int, ClientResult] = {}
        per_pass: list[int] = []
        total = PassStats()
        errors: list[str] = []
        deadline = time.monotonic() + (run.cfg.runtime.worker_timeout_s or float("inf"))
        worker_private: list[float] = []
        worker_accelerator: list[float] = []
        for i, share in enumerate(shares):
            conn = self.conns[i]
            try:
                if i not in sent or conn is None:
                    raise EOFError
                answer = self._wait(self.procs[i], conn, deadline, f"worker {i}")
            except (EOFError, OSError, TimeoutError) as exc:
                why = self._died(i, str(exc) if isinstance(exc, TimeoutError) else None)
                for cid in share:
                    out[cid] = (None, len(wire.encode(payloads[cid])), 0, why)
                run.progress.clients_done(share)
                continue
            if answer[0] == "error":
                errors.append(f"worker {i}: {answer[1]}")
                continue
            results, states, reports, k, passes, limit, private, accelerator = answer
            if limit is not None and (self.cohort is not None) and (self.cohort.limit is None or
                                                                    limit < self.cohort.limit):
                self.cohort.limit = limit  # (memory ran out in the worker: the run's checkpoint keeps the halving)
            if private is not None:
                worker_private.append(private)
            if accelerator is not None:
                worker_accelerator.append(accelerator)
            for cid, state in states.items():
                if state or cid in run.client_states:
                    run.client_states[cid] = state
            for report in reports:
                for observer in run.observers:
                    observer.on_client_report(*report)
            out.update(results)
            if k is not None:
                per_pass.append(k)
            if passes is not None:
                total = total + passes
            run.progress.clients_done(share)
        if errors:  # (after every worker answered: the pipes hold no stale answer)
            raise RuntimeError("a client's training failed in a worker process:\n" + "\n".join(errors))
        self.pass_info = {"workers": len(shares), **({"clients_per_pass": max(per_pass)} if per_pass else {}),
                          **pass_row(PassStats(), total),
                          **({"worker_private_mb": max(worker_private)} if worker_private else {}),
                          **({"worker_accelerator_mb": max(worker_accelerator)} if worker_accelerator else {})}
        return {cid: out[cid] for cid in cids}

    def _wait(self, proc: BaseProcess | None, conn: Connection, deadline: float, who: str) -> Any:
        """The answer of ``who``; EOFError if it died, TimeoutError past ``deadline`` (runtime.worker_timeout_s)."""
        while not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if proc is None or not proc.is_alive():
                if conn.poll():  # (it answered, then ended)
                    break
                raise EOFError
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{who} did not answer within runtime.worker_timeout_s "
                                   f"{self.run.cfg.runtime.worker_timeout_s:g} s and was killed")
        return conn.recv()

    def _shares(self, cids: list[int]) -> list[list[int]]:
        """The round's clients cut into at most ``workers`` contiguous shares as even as whole fused passes allow
        (a share holds whole groups of clients_per_pass, so the passes are the ones one process would run)."""
        configured = self.run.cfg.runtime.clients_per_pass
        k = 1
        if configured != "auto":
            k = int(configured)
        elif self.cohort is not None and self.cohort.chosen is not None:
            k = self.cohort.chosen
        if self.cohort is not None and self.cohort.limit:
            k = min(k, self.cohort.limit)
        groups = [cids[i:i + k] for i in range(0, len(cids), k)]
        return [[c for g in share for c in g] for share in _even(groups, min(self.workers or 1, len(groups)))]

    def _died(self, i: int, timed_out: str | None = None) -> str:
        """The reason a worker's clients failed; the worker is gone (a new one is forked for the next round)."""
        proc = self.procs[i]
        code = None
        if proc is not None:
            proc.join(timeout=0 if timed_out else 5)
            if proc.is_alive():  # (past its time, or its pipe broke but it runs on: it is not left behind)
                proc.kill()
                proc.join()
            code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        why = (f"{timed_out}; a new worker takes the next round" if timed_out else
               f"worker {i} died ({how}) while training this client; a new worker takes the next round")
        log.warning("round: %s", why)
        if self.conns[i] is not None:
            self.conns[i].close()  # type: ignore[union-attr]
        self.procs[i], self.conns[i] = None, None
        self.building.discard(i)
        self.devices.pop(i, None)
        return why
