"""Buffered asynchronous aggregation in real time (fedpeft.runtime.realtime_async), the schedule a Flower run uses
under federation.asynchronous, here over an in-process transport that hands results over in a fixed order: the
staleness of each update follows from the order of arrival, the updates that arrived after a full buffer wait
for the next window, and a killed run resumes with them. (tests/test_flower.py runs it on real Flower processes.)"""

from __future__ import annotations

import pytest
from helpers import crash_at_round, metrics_difference, tiny_config, without_timings

from fedpeft.rundir import read_metrics
from fedpeft.runtime.inprocess import InProcessTransport
from fedpeft.runtime.realtime_async import RealTimeBufferedAsync

pytestmark = pytest.mark.needs_data


class LateInReverse(InProcessTransport):
    """A streaming transport in this process: a client trains when it is started, and the clients started together
    are handed over at the next poll, highest client id first."""

    rounds_in_real_time = True

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[tuple[int, int, tuple]] = []

    def start_clients(self, draw, payloads):
        results = self.run_clients(draw, payloads)
        self.queue += [(cid, draw, results[cid]) for cid in sorted(results, reverse=True)]
        return {cid: r[1] for cid, r in results.items()}, {}

    def poll_arrivals(self):
        due, self.queue = self.queue, []
        return due

    def unavailable(self):
        return set()


def eight_clients():
    return tiny_config("federation.num_clients=8", "federation.clients_per_round=3", "federation.rounds=4",
                       "federation.asynchronous={rule: fedbuff, buffer_size: 1}")


def test_updates_are_as_stale_as_the_aggregations_since_they_started(tmp_path):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    rt = EmbeddedRuntime(eight_clients(), tmp_path / "run", transport=LateInReverse())
    assert isinstance(rt.schedule, RealTimeBufferedAsync)
    rt.run()
    rows = read_metrics(tmp_path / "run")[1:]
    # three start together; one update per aggregation, the highest id first; the slots refill when all are used
    assert [list(r["client_staleness"].values()) for r in rows] == [[0], [1], [2], [0]]
    assert [r["async_started"] for r in rows] == [3, 0, 0, 3]
    first = rows[0]["clients"][0]
    assert rows[1]["clients"][0] < first and rows[2]["clients"][0] < rows[1]["clients"][0]
    assert all(r["sim_time_s"] is None and r["sim_online_wait_s"] is None for r in rows)
    assert rt.transport.queue == [] and len(rt.schedule.arrived) == 2  # the fourth refill's other two wait


def test_a_killed_real_time_run_resumes_with_the_updates_that_had_arrived(tmp_path, monkeypatch):
    from fedpeft.runtime.embedded import EmbeddedRuntime

    EmbeddedRuntime(eight_clients(), tmp_path / "full", transport=LateInReverse()).run()
    rt = EmbeddedRuntime(eight_clients(), tmp_path / "cut", transport=LateInReverse())
    crash_at_round(rt, monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        rt.run()
    monkeypatch.undo()
    resumed = EmbeddedRuntime.resume(tmp_path / "cut", transport=LateInReverse())
    assert isinstance(resumed.schedule, RealTimeBufferedAsync)
    (waiting,) = resumed.schedule.arrived  # the first refill's last update, with the model it started from
    assert waiting.version == 0 and 0 in resumed.schedule.starts and waiting.update is not None
    resumed.run()
    full, cut = without_timings(read_metrics(tmp_path / "full")), without_timings(read_metrics(tmp_path / "cut"))
    assert metrics_difference(cut, full) is None
