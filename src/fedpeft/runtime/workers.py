"""A round's clients on several worker processes of this machine (``runtime.workers``), over one frozen backbone.

The workers are forked from the run's process once the experiment is built (model, data, PEFT method), when the run
starts, and live until it ends. A fork shares the parent's memory copy-on-write: the frozen backbone's weights are
never written, so every worker reads the one copy the parent loaded; only what a worker writes (the trainable
tensors, activations, optimizer state) becomes its own. Each worker runs with ``runtime.threads`` (or the host's
cores) divided among the workers as torch threads.

A round's clients are split into contiguous shares, one per worker; each worker trains its share as the in-process
transport does (one after another, or ``clients_per_pass`` at a time in fused passes) and sends back each client's
result, its algorithm state (the parent keeps every client's state, and checkpoints it) and what its client half
reported to the run's observers (replayed here in client order). A client's update depends only on (seed, round,
client) and its payload and state, so which worker trains it changes nothing beyond float32 rounding (the
workers' torch threads reduce in another order).

A worker that dies (killed, out of memory) fails the clients of its share for that round, with the reason, and a new
worker is forked before the next round. Workers ask the kernel to kill them when the run's process dies
(PR_SET_PDEATHSIG), so none outlives a killed run.

Why not torch.multiprocessing with spawn: a spawned worker would rebuild the experiment (the model load, the
tokenisation) and need the tuned model pickled through shared memory; a fork after the build shares it for free.
CUDA cannot be forked into, so on a GPU machine the workers (one per device) are a later step; they are refused
there for now.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from fedpeft import wire
from fedpeft.algorithms import runtime_needs
from fedpeft.config import ConfigError
from fedpeft.runtime.cohort import pass_row
from fedpeft.runtime.inprocess import InProcessTransport
from fedpeft.runtime.outcome import ClientResult
from fedpeft.training.fused import PassStats

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from fedpeft.runtime.embedded import EmbeddedRuntime

log = logging.getLogger("fedpeft")

PR_SET_PDEATHSIG = 1


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


def _serve(conn: Connection, transport: InProcessTransport, threads: int, parent: int) -> None:
    """A worker's loop: (round, payloads, states) in, (results, states, reports, pass figures) out; None ends it."""
    _die_with_parent()
    if os.getppid() != parent:  # (the parent died before the request above took effect)
        os._exit(0)
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
        rnd, payloads, states = request
        run.client_states = dict(states)
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
        conn.send((results, {cid: run.client_states.get(cid, {}) for cid in payloads}, reports.kept,
                   transport.round_info().get("clients_per_pass"), passes))
    conn.close()
    os._exit(0)  # (no atexit of the parent's: its files and locks are the parent's)


class WorkerPoolTransport(InProcessTransport):
    """The clients of a round on ``runtime.workers`` forked worker processes (see the module's text)."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.procs: list[BaseProcess | None] = [None] * workers
        self.conns: list[Connection | None] = [None] * workers

    def bind(self, run: EmbeddedRuntime, checkpoint: dict[str, Any] | None) -> None:
        if run.exp.device.type != "cpu":
            raise ConfigError(f"runtime.workers {self.workers}: the run trains on {run.exp.device.type}, and the "
                              "workers are forked processes, which CUDA cannot be forked into; set runtime.device: "
                              "cpu or runtime.workers: 1")
        if runtime_needs(run.cfg.algorithm).server_model:
            raise ConfigError(f"runtime.workers {self.workers} with algorithm {run.cfg.algorithm.name}: an algorithm "
                              "that trains a model on the server gives its client halves state built in their own "
                              "process, which the workers do not share yet; set runtime.workers: 1")
        super().bind(run, checkpoint)
        self.threads = max(1, (run.cfg.runtime.threads or torch.get_num_threads()) // self.workers)

    def start(self) -> None:
        for i in range(self.workers):
            self._fork(i)

    def _fork(self, i: int) -> None:
        ctx = multiprocessing.get_context("fork")
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs, self, self.threads, os.getpid()), daemon=True,
                           name=f"fedpeft-worker-{i}")
        proc.start()
        theirs.close()
        self.procs[i], self.conns[i] = proc, mine

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

    def run_clients(self, rnd: int, payloads: dict[int, wire.Payload]) -> dict[int, ClientResult]:
        """Every client's result: the round's clients in ``workers`` contiguous shares, trained at once."""
        run = self.run
        cids = list(payloads)
        if not cids:
            return {}
        shares = self._shares(cids)
        for i in range(len(shares)):
            proc = self.procs[i]
            if proc is None or not proc.is_alive():
                self._fork(i)
        sent: list[int] = []
        for i, share in enumerate(shares):
            run.progress.clients_training(share)
            conn = self.conns[i]
            assert conn is not None
            try:
                conn.send((rnd, {c: payloads[c] for c in share}, {c: run.client_states.get(c, {}) for c in share}))
                sent.append(i)
            except (BrokenPipeError, OSError):
                pass
        out: dict[int, ClientResult] = {}
        per_pass: list[int] = []
        total = PassStats()
        errors: list[str] = []
        for i, share in enumerate(shares):
            conn = self.conns[i]
            try:
                if i not in sent or conn is None:
                    raise EOFError
                answer = conn.recv()
            except (EOFError, OSError):
                why = self._died(i)
                for cid in share:
                    out[cid] = (None, len(wire.encode(payloads[cid])), 0, why)
                run.progress.clients_done(share)
                continue
            if answer[0] == "error":
                errors.append(f"worker {i}: {answer[1]}")
                continue
            results, states, reports, k, passes = answer
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
        self.pass_info = {**({"clients_per_pass": max(per_pass)} if per_pass else {}), **pass_row(PassStats(), total)}
        return {cid: out[cid] for cid in cids}

    def _shares(self, cids: list[int]) -> list[list[int]]:
        """The round's clients cut into at most ``workers`` contiguous shares as even as whole fused passes allow
        (a share holds whole groups of clients_per_pass, so the passes are the ones one process would run)."""
        configured = self.run.cfg.runtime.clients_per_pass
        k = int(configured) if configured != "auto" else 1
        if self.cohort is not None and self.cohort.limit:
            k = min(k, self.cohort.limit)
        groups = [cids[i:i + k] for i in range(0, len(cids), k)]
        n = min(self.workers, len(groups))
        bounds = [round(j * len(groups) / n) for j in range(n + 1)]
        return [[c for g in groups[bounds[j]:bounds[j + 1]] for c in g] for j in range(n)]

    def _died(self, i: int) -> str:
        """The reason a worker's clients failed; the worker is gone (a new one is forked for the next round)."""
        proc = self.procs[i]
        code = None
        if proc is not None:
            proc.join(timeout=5)
            if proc.is_alive():  # (its pipe broke but it runs on: it is not left behind)
                proc.kill()
                proc.join()
            code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        why = f"worker {i} died ({how}) while training this client; a new worker takes the next round"
        log.warning("round: %s", why)
        if self.conns[i] is not None:
            self.conns[i].close()  # type: ignore[union-attr]
        self.procs[i], self.conns[i] = None, None
        return why
