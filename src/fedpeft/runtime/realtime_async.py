"""Buffered asynchronous aggregation in real time (``federation.asynchronous`` on the Flower runtime): FedBuff and
FedAsync over a transport that starts clients without waiting for them (fedpeft.runtime.transport.StreamingTransport).

The rules are the simulated schedule's (fedpeft.runtime.asynchronous): ``clients_per_round`` clients train at once,
each from the global version current when its slot was filled; every ``buffer_size`` updates, the server rebases
them onto the current model by their staleness weight (or mixes them in, FedAsync) and aggregates them with the
algorithm's own ``aggregate()``; a slot is refilled as soon as its client's reply is taken. What differs is the
clock: arrivals are the replies in the order the SuperLink hands them over, so which update is how stale depends on
the real devices and links, and a run is not reproducible update for update (the synchronous Flower runtime is).
The rows carry no simulated time (the ``sim_*`` entries are null): ``wall_s`` and ``time_round_s`` are the run's
real timeline.

A client has ``federation.round_timeout_s`` from its push to answer: one whose reply is not there at the first poll
after that is a failed update and its slot is refilled (its message lives ``runtime.flower.reply_grace_s`` longer on
the SuperLink, so that a reply that came while the server was aggregating or evaluating is not lost). Updates that arrived after the buffer was
full wait for the next window, and a checkpoint keeps them; the clients still training when a run is killed are not
in it (their messages belong to the Flower run that sent them): a resumed run refills their slots.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fedpeft.runtime.asynchronous import BufferedAsync, StepRecord, Task
from fedpeft.runtime.transport import StreamingTransport

if TYPE_CHECKING:
    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.runtime.outcome import RoundOutcome

log = logging.getLogger("fedpeft")


class RealTimeBufferedAsync(BufferedAsync):
    """The asynchronous schedule of a run whose transport streams its clients (Flower): one aggregation per
    :meth:`step`, on the wall clock."""

    def __init__(self, runtime: EmbeddedRuntime):
        super().__init__(runtime)
        transport = runtime.transport
        if not isinstance(transport, StreamingTransport):
            raise TypeError(f"{type(transport).__name__} cannot start clients without waiting for them")
        self.transport: StreamingTransport = transport
        self.arrived: list[Task] = []  # taken from the transport, not in the buffer yet (oldest first)
        self.started_at = time.perf_counter()

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The refills and aggregations so far and the updates that arrived and wait for the next window; the clients
        still training are not kept (their replies belong to this Flower run)."""
        assert not self.buffer, "checkpointed between aggregations only"
        versions = {t.version for t in self.arrived} | {self.version}
        return {"draws": self.draws, "version": self.version, "last_aggregation_s": self.last_aggregation_s,
                "in_flight": [t.state() for t in self.arrived],
                "starts": {str(v): arrays for v, arrays in self.starts.items() if v in versions}}

    def load_state(self, state: dict[str, Any] | None) -> None:
        super().load_state(state)
        self.arrived, self.in_flight = self.in_flight, []
        log.warning("resumed asynchronous run: %d updates that had arrived wait for the next aggregation; clients "
                    "still training when the run stopped are not waited for, their slots are refilled",
                    len(self.arrived))

    # -- the window -----------------------------------------------------------------------------------------------
    def _busy(self) -> set[int]:
        return super()._busy() | {t.client for t in self.arrived} | self.transport.unavailable()

    def _pending(self) -> list[Task]:
        return [*self.in_flight, *self.arrived]

    def _requeue(self, tasks: list[Task]) -> None:
        self.arrived[:0] = tasks

    def _start(self, out: RoundOutcome, record: StepRecord) -> None:
        """Fill the free slots with clients that are neither training nor waiting to be aggregated; clients that
        could not be started arrive at once as failed."""
        free = self.concurrency - len(self.in_flight)
        if free <= 0:
            return
        busy = self._busy()
        idle = [c for c in range(self.rt.cfg.federation.num_clients) if c not in busy]
        if not idle:
            return
        chosen, payloads = self._draw(idle, free)
        sent = time.perf_counter()
        started, failed = self.transport.start_clients(self.draws, payloads)
        record.training_s += time.perf_counter() - sent
        elapsed = self.elapsed()
        for cid in chosen:
            record.started += 1
            n_down = started[cid] if cid in started else failed[cid][1]
            out.bytes_down[cid] = out.bytes_down.get(cid, 0) + n_down
            task = Task(cid, self.draws, self.version, elapsed, elapsed, n_down)
            if cid in started:
                self.in_flight.append(task)
            else:
                task.failure = failed[cid][3] or "not started"
                self.arrived.append(task)

    def _take_arrivals(self, record: StepRecord) -> None:
        """Move the replies the transport has now (waiting one poll interval when it has none) to ``arrived``."""
        polled = time.perf_counter()
        arrivals = self.transport.poll_arrivals()
        record.training_s += time.perf_counter() - polled
        elapsed = self.elapsed()
        for cid, draw, (update, _, n_up, failure) in arrivals:
            task = next((t for t in self.in_flight if t.client == cid and t.draw == draw), None)
            if task is None:  # (not started by this schedule: a reply the transport should not have handed over)
                log.warning("a reply from client %d (refill %d) that no slot waits for: ignored", cid, draw)
                continue
            self.in_flight.remove(task)
            task.update, task.bytes_up, task.failure, task.arrival_s = update, n_up, failure, elapsed
            self.arrived.append(task)

    def _row(self, rnd: int, record: StepRecord) -> dict[str, Any]:
        row = super()._row(rnd, record)  # no task has a simulated time: every sim_* timing is null
        for key in ("sim_round_s", "sim_time_s", "sim_download_s", "sim_compute_s", "sim_upload_s", "sim_wait_s",
                    "sim_online_wait_s"):
            row[key] = None
        return row

    def elapsed(self) -> float:
        """Wall seconds of the run so far (this process's)."""
        return time.perf_counter() - self.started_at

    def step(self, rnd: int, out: RoundOutcome) -> dict[str, Any]:
        """Refill the free slots and take the replies as they come until ``buffer_size`` updates are in the buffer,
        then aggregate them as aggregation ``rnd``; an aggregation window in which ``num_clients`` arrivals in a row
        brought no update ends as a failed round."""
        record = StepRecord()
        self.rt.progress.round_started(rnd, [])
        tc = time.perf_counter()
        fruitless, give_up = 0, self.rt.cfg.federation.num_clients
        while len(self.buffer) < self.k and fruitless < give_up:
            if self.arrived:
                task = self.arrived.pop(0)
                fruitless = 0 if self._arrive(task, out, record) else fruitless + 1
                continue
            self._start(out, record)
            if not self.arrived:
                self._take_arrivals(record)
        out.time_client_s = time.perf_counter() - tc
        return self._close(rnd, out, record, give_up)
