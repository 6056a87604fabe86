"""Buffered asynchronous aggregation on the simulated clock (``federation.asynchronous``): FedBuff (Nguyen et al.,
2022) and FedAsync (Xie et al., 2019).

``clients_per_round`` clients train at once. Each starts from the global model current when its slot was filled,
and its update arrives when its simulated download, computation and upload are done
(fedpeft.system.clock). A slot is refilled at once, with a client that is online, not training and not waiting
in the buffer. Every ``buffer_size`` arrivals, the server aggregates with the algorithm's own ``aggregate()``. Each
update is first rebased onto the current model, ``x_now + w(s) (x_client - x_start)`` (FedBuff), or mixed with it,
``x_now + mixing w(s) (x_client - x_now)`` (FedAsync), where ``s`` is the number of aggregations since the client
started.

At one simulated instant, arrivals come first (by client id), then the aggregation when the buffer is full, then
the refills: clients that start together start from the same model and train in one fused pass
(``runtime.clients_per_pass``). A client is trained when it starts, so its update, its FLOPs and hence its
arrival are known. The in-flight updates are held in memory until they arrive, and checkpointed with the clock,
so a killed run resumes to the same result.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fedpeft import wire
from fedpeft.config.asynchronous import staleness_weight
from fedpeft.runtime.cohort import pass_row
from fedpeft.runtime.inprocess import InProcessTransport
from fedpeft.runtime.simclock import work_of
from fedpeft.runtime.updates import accept_updates
from fedpeft.system.clock import ClientTime, client_time

if TYPE_CHECKING:
    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.runtime.outcome import RoundOutcome

log = logging.getLogger("fedpeft")


@dataclass
class Task:
    """One client's training: drawn in refill ``draw`` (its round number for seeds and checks), from global version
    ``version``, started at ``start_s`` and arriving at ``arrival_s`` (simulated seconds)."""

    client: int
    draw: int
    version: int
    start_s: float
    arrival_s: float
    bytes_down: int
    bytes_up: int = 0
    update: wire.Payload | None = None
    failure: str | None = None
    time: ClientTime | None = None
    accepted: bool = False  # it arrived and passed the checks once (it waits for a window after a failed one)

    def state(self) -> dict[str, Any]:
        """The task as a checkpoint holds it (arrays and JSON-safe values)."""
        return {"client": self.client, "draw": self.draw, "version": self.version, "start_s": self.start_s,
                "arrival_s": self.arrival_s, "bytes_down": self.bytes_down, "bytes_up": self.bytes_up,
                "failure": self.failure, "accepted": self.accepted,
                "time": None if self.time is None else [self.time.download_s, self.time.compute_s, self.time.upload_s],
                "arrays": None if self.update is None else dict(self.update.arrays),
                "meta": None if self.update is None else json_meta(self.update.meta)}

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> Task:
        update = None if s["arrays"] is None else wire.Payload(
            {k: np.asarray(v) for k, v in s["arrays"].items()}, dict(s["meta"]))
        return cls(client=int(s["client"]), draw=int(s["draw"]), version=int(s["version"]),
                   start_s=float(s["start_s"]), arrival_s=float(s["arrival_s"]), bytes_down=int(s["bytes_down"]),
                   bytes_up=int(s["bytes_up"]), update=update, failure=s["failure"],
                   time=None if s["time"] is None else ClientTime(*map(float, s["time"])),
                   accepted=bool(s.get("accepted", False)))


def json_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """An update's metadata as the wire carries it (JSON values), for the checkpoint."""
    return wire.decode(wire.encode(wire.Payload({}, meta))).meta


@dataclass
class StepRecord:
    """What one aggregation's window held, for its metrics row."""

    staleness: dict[int, int] = field(default_factory=dict)
    started: int = 0
    dropped: int = 0
    online_wait_s: float = 0.0
    training_s: float = 0.0  # host seconds in the clients' training (the rest of the loop is the schedule's own)


class BufferedAsync:
    """The asynchronous schedule of a run: it drives the run's transport (``transport.run_clients``) and its
    server half, one aggregation per :meth:`step`."""

    def __init__(self, runtime: EmbeddedRuntime):
        cfg = runtime.cfg
        options = cfg.federation.asynchronous
        assert options is not None
        self.rt = runtime
        self.options = options
        self.concurrency = cfg.federation.clients_per_round
        self.k = options.buffer(self.concurrency)
        self.weighting = options.weighting()
        self.in_flight: list[Task] = []
        self.buffer: list[Task] = []
        self.draws = 0  # refills so far: the round number of the clients they start
        self.version = 0  # aggregations so far
        self.last_aggregation_s = 0.0
        self.starts: dict[int, dict[str, np.ndarray]] = {}  # version -> the arrays its clients started from

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        assert not self.buffer, "checkpointed between aggregations only"
        return {"draws": self.draws, "version": self.version, "last_aggregation_s": self.last_aggregation_s,
                "in_flight": [t.state() for t in self.in_flight],
                "starts": {str(v): arrays for v, arrays in self.starts.items()}}

    def load_state(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no asynchronous schedule (clients in flight, the models they "
                             "started from): it is a synchronous run's")
        self.draws, self.version = int(state["draws"]), int(state["version"])
        self.last_aggregation_s = float(state["last_aggregation_s"])
        self.in_flight = [Task.from_state(s) for s in state["in_flight"]]
        self.starts = {int(v): {k: np.asarray(a) for k, a in arrays.items()} for v, arrays in state["starts"].items()}

    # -- the clock's events ---------------------------------------------------------------------------------------
    @property
    def now_s(self) -> float:
        return self.rt.system.now_s

    def _busy(self) -> set[int]:
        return {t.client for t in self.in_flight} | {t.client for t in self.buffer}

    def _fill(self, out: RoundOutcome, record: StepRecord) -> None:
        """Refill the free slots now, with online clients that are neither training nor waiting in the buffer; train
        them (one fused pass where the runtime fuses) and schedule their arrivals."""
        free = self.concurrency - len(self.in_flight)
        if free <= 0:
            return
        busy = self._busy()
        online = self.rt.system.online_now()
        idle = [c for c in (range(self.rt.cfg.federation.num_clients) if online is None else online) if c not in busy]
        if not idle:
            return
        chosen, payloads = self._draw(idle, free)
        trained = time.perf_counter()
        results = self.rt.transport.run_clients(self.draws, payloads)
        record.training_s += time.perf_counter() - trained
        for cid in chosen:
            update, n_down, n_up, failure = results[cid]
            out.bytes_down[cid] = out.bytes_down.get(cid, 0) + n_down
            record.started += 1
            task = Task(cid, self.draws, self.version, self.now_s, self.now_s, n_down, n_up, update, failure)
            devices = self.rt.system.devices
            if update is not None:
                work = work_of(update.meta)
                task.time = client_time(devices, cid, n_down, work or 0.0, n_up)
                task.arrival_s = self.now_s + task.time.total_s
            else:  # failed on the client: known when its download is done
                task.arrival_s = self.now_s + client_time(devices, cid, n_down, 0.0, 0).download_s
            leaves = self.rt.system.leaves_at(cid)  # > now: the client is online now
            if leaves < task.arrival_s and task.failure is None:
                task.failure = (f"went offline {leaves - self.now_s:.3g} s (simulated) after it started, before its "
                                f"update arrived at {task.arrival_s - self.now_s:.3g} s")
                task.arrival_s = leaves
                task.update = None
            self.in_flight.append(task)

    def _draw(self, idle: list[int], free: int) -> tuple[list[int], dict[int, wire.Payload]]:
        """A refill: choose up to ``free`` of the ``idle`` clients and configure them from the current model (kept
        in ``starts`` for rebasing their updates); (chosen, their payloads)."""
        self.draws += 1
        server = self.rt.server
        chosen = server.select_among(self.draws, idle, free)
        payloads = server.configure(self.draws, chosen)
        for observer in self.rt.observers:  # (an asynchronous run's "round" here is the refill's number)
            observer.on_configure(self.draws, payloads)
        self.rt.progress.selected += len(payloads)  # the bar counts the trainings of this aggregation's window
        start = self.starts.setdefault(self.version, {})
        for payload in payloads.values():
            for key, value in payload.arrays.items():
                if key not in start:
                    start[key] = np.array(value, dtype=np.float32, copy=True)
        self.rt.progress.clients_training(list(payloads))
        return chosen, payloads

    def _wait_for_a_client(self, record: StepRecord) -> None:
        """No client trains and none can start: move the clock to when one that is not waiting in the buffer comes
        online."""
        availability = self.rt.system.devices.availability
        when = None if availability is None else availability.next_online(self.now_s, self._busy())
        if when is None or when <= self.now_s:
            raise RuntimeError(f"no client can start training after simulated {self.now_s:.0f} s: every client is "
                               "offline for good or waiting in the buffer; lower buffer_size or clients_per_round")
        record.online_wait_s += when - self.now_s
        self.rt.system.now_s = when

    def _arrive(self, task: Task, out: RoundOutcome, record: StepRecord) -> bool:
        """Take ``task``'s arrival: into the buffer (True), or refused, failed or dropped (False). An update back
        from a failed window was counted and checked when it first arrived: only its staleness is checked again."""
        cid = task.client
        if not task.accepted:
            out.bytes_up[cid] = out.bytes_up.get(cid, 0) + task.bytes_up
            self.rt.progress.clients_done([cid])
            if task.failure is not None or task.update is None:
                out.rejected[cid] = task.failure or "no update"
                if "went offline" in (task.failure or ""):
                    record.dropped += 1
                log.warning("update %d of client %d failed: %s", task.draw, cid, out.rejected[cid])
                return False
            _, refused = accept_updates(self.rt.server, task.draw, {cid: task.update})
            if refused:
                out.rejected.update(refused)
                return False
            task.accepted = True
        staleness = self.version - task.version
        limit = self.options.max_staleness
        if limit is not None and staleness > limit:
            out.rejected[cid] = (f"started {staleness} aggregations ago, more than "
                                 f"federation.asynchronous.max_staleness={limit}")
            record.dropped += 1
            log.warning("update of client %d dropped: %s", cid, out.rejected[cid])
            return False
        out.rejected.pop(cid, None)  # (an earlier update of this window failed; this one is aggregated)
        self.buffer.append(task)
        return True

    def _rebased(self, task: Task) -> wire.Payload:
        """The update as the algorithm's aggregate() takes it: a change made from the model the client started from,
        moved onto the current model and weighted by its staleness (FedBuff), or mixed with it (FedAsync)."""
        assert task.update is not None
        staleness = self.version - task.version
        weight = staleness_weight(self.weighting, staleness, self.options.staleness_a, self.options.staleness_b)
        current = self.rt.server.global_state
        arrays = task.update.arrays
        if self.options.rule == "fedasync":
            factor = np.float32(self.options.mixing * weight)
            moved = {k: (current[k] + factor * (v.astype(np.float32) - current[k])).astype(np.float32)
                     for k, v in arrays.items()}
        elif staleness == 0 and weight == 1.0:
            return task.update  # started from the current model: as in a synchronous round
        else:
            start = self.starts[task.version]
            missing = sorted(set(arrays) - set(start))
            if missing:
                raise RuntimeError(f"algorithm {self.rt.cfg.algorithm.name}: the update of client {task.client} holds "
                                   f"{missing[0]!r}, which its payload did not; an algorithm that aggregates "
                                   "asynchronously sends every tensor it receives back")
            w = np.float32(weight)
            moved = {k: (current[k] + w * (v.astype(np.float32) - start[k])).astype(np.float32)
                     for k, v in arrays.items()}
        return wire.Payload(moved, task.update.meta)

    def step(self, rnd: int, out: RoundOutcome) -> dict[str, Any]:
        """Run the clock until ``buffer_size`` updates have arrived, then aggregate them as aggregation ``rnd``;
        fills ``out`` and returns the row's own entries. At each instant: the arrivals due (by client id), then
        the refills; an aggregation window in which ``num_clients`` arrivals in a row brought no update (every
        client fails) ends as a failed round."""
        record = StepRecord()
        self.rt.progress.round_started(rnd, [])
        transport = self.rt.transport
        cohort = transport.cohort if isinstance(transport, InProcessTransport) else None
        before = dataclasses.replace(cohort.stats) if cohort is not None else None
        tc = time.perf_counter()
        fruitless, give_up = 0, self.rt.cfg.federation.num_clients
        while len(self.buffer) < self.k and fruitless < give_up:
            due = sorted((t for t in self.in_flight if t.arrival_s <= self.now_s),
                         key=lambda t: (t.arrival_s, t.client, t.draw))
            if due:
                for task in due:
                    if len(self.buffer) >= self.k:
                        break
                    self.in_flight.remove(task)
                    fruitless = 0 if self._arrive(task, out, record) else fruitless + 1
                continue
            self._fill(out, record)
            self._advance(record)
        out.time_client_s = time.perf_counter() - tc
        if cohort is not None and before is not None:  # the window's fused passes, all its refills together
            assert isinstance(transport, InProcessTransport)
            transport.pass_info.update(pass_row(before, cohort.stats))
        return self._close(rnd, out, record, give_up)

    def _requeue(self, tasks: list[Task]) -> None:
        """Updates that waited in the buffer of a failed window: aggregated with the next window."""
        for task in tasks:  # back in flight: arrived now
            task.arrival_s = self.now_s
        self.in_flight.extend(tasks)

    def _close(self, rnd: int, out: RoundOutcome, record: StepRecord, give_up: int) -> dict[str, Any]:
        """End the aggregation window: aggregate the buffer as aggregation ``rnd`` into ``out`` (or fail the window
        when fewer than buffer_size updates arrived) and return the row's own entries."""
        schedule_s = out.time_client_s - record.training_s
        if len(self.buffer) < self.k:  # (every arrival of the window failed)
            out.failed = (f"{give_up} arrivals in a row brought no update that could be aggregated (see rejected); "
                          f"{len(self.buffer)} of buffer_size {self.k} waited")
            self._requeue(self.buffer)
            self.buffer = []
            self.rt.server.observe_failures(rnd, out.rejected)
            row = self._row(rnd, record)
            row["time_schedule_s"] = schedule_s
            self.last_aggregation_s = self.now_s
            return row
        record.staleness = {t.client: self.version - t.version for t in self.buffer}
        ta = time.perf_counter()
        rebasing = time.perf_counter()
        updates = {t.client: self._rebased(t) for t in self.buffer}
        schedule_s += time.perf_counter() - rebasing
        self.rt.server.observe_failures(rnd, out.rejected)
        out.metas = {t.client: t.update.meta for t in self.buffer if t.update is not None}
        out.agg = self.rt.server.aggregate(rnd, updates)
        out.time_aggregation_s = time.perf_counter() - ta
        row = self._row(rnd, record)
        row["time_schedule_s"] = schedule_s  # the schedule's own host seconds: events, selection, rebasing
        self.buffer = []
        self.version += 1
        self.last_aggregation_s = self.now_s
        kept = {t.version for t in self._pending()} | {self.version}
        self.starts = {v: a for v, a in self.starts.items() if v in kept}
        return row

    def _pending(self) -> list[Task]:
        """The tasks not aggregated yet (their start models are kept)."""
        return self.in_flight

    def _advance(self, record: StepRecord) -> None:
        """Move the clock to the next event: the next arrival or, while a slot is free, the next time a client
        that could take it comes online, whichever is first."""
        availability = self.rt.system.devices.availability
        joins = None
        if len(self.in_flight) < self.concurrency and availability is not None:
            joins = availability.next_online(self.now_s, self._busy())
            joins = joins if joins is not None and joins > self.now_s else None
        arrives = min((t.arrival_s for t in self.in_flight), default=None)
        if arrives is None and joins is None:  # nothing in flight, and no client could start: wait for one
            self._wait_for_a_client(record)
            return
        nxt = min(x for x in (arrives, joins) if x is not None)
        if not self.in_flight:
            record.online_wait_s += nxt - self.now_s
        self.rt.system.now_s = max(nxt, self.now_s)

    def _row(self, rnd: int, record: StepRecord) -> dict[str, Any]:
        """The aggregation's own entries: its clients and their staleness, and its simulated time (the seconds since
        the previous aggregation; the aggregated clients' mean download, computation and upload, and their mean
        wait in the buffer: null in a failed window, which aggregated no client)."""
        times = [t.time for t in self.buffer if t.time is not None]
        known = len(times) == len(self.buffer) and all(work_of(t.update.meta if t.update else None) is not None
                                                       for t in self.buffer)
        split = known and bool(times)
        n = max(len(times), 1)
        row: dict[str, Any] = {
            "clients": [t.client for t in self.buffer],
            "client_staleness": {str(c): s for c, s in record.staleness.items()},
            "async_started": record.started,
            "sim_round_s": self.now_s - self.last_aggregation_s if known else None,
            "sim_time_s": self.now_s if known else None,
            "sim_download_s": sum(t.download_s for t in times) / n if split else None,
            "sim_compute_s": sum(t.compute_s for t in times) / n if split else None,
            "sim_upload_s": sum(t.upload_s for t in times) / n if split else None,
            "sim_wait_s": sum(self.now_s - t.arrival_s for t in self.buffer) / n if split else None,
            "sim_online_wait_s": record.online_wait_s,
            "client_sim_s": {str(t.client): (t.time.total_s if t.time is not None else None) for t in self.buffer},
            "sim_dropped": record.dropped,
        }
        if not math.isfinite(self.now_s):
            raise RuntimeError("the simulated clock is not finite")
        return row
