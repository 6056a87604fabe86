"""The synchronous schedule: every round, the clock waits until enough clients are online, the server selects among
them and configures each selected client's payload, the transport trains them, the server checks the updates, the
clock says which of them arrived in time (system.deadline_s, over_selection, clients going offline) and the server
aggregates those. Its counterpart is the buffered asynchronous schedule (fedpeft.runtime.asynchronous)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fedpeft import wire
from fedpeft.runtime.outcome import RoundOutcome
from fedpeft.runtime.simclock import RoundStart
from fedpeft.runtime.updates import accept_updates

if TYPE_CHECKING:
    from fedpeft.runtime.embedded import EmbeddedRuntime

log = logging.getLogger("fedpeft")


class SynchronousRounds:
    """One round per :meth:`step`; the server's and the clock's parts are the run's."""

    def __init__(self, run: EmbeddedRuntime):
        self.rt = run
        self.round_start = RoundStart(None, 0.0)

    def state(self) -> dict[str, Any] | None:
        return None  # (everything a round needs is the server's and the clock's, checkpointed by the run)

    def load_state(self, state: dict[str, Any] | None) -> None:
        pass

    def step(self, rnd: int, out: RoundOutcome) -> dict[str, Any]:
        """Run round ``rnd``: fills ``out`` and returns the row's own entries (the clients selected and the
        round's simulated time)."""
        rt = self.rt
        self.round_start = start = rt.system.round_start(rnd)
        rt.server.online = start.online
        selected = rt.server.select(rnd)
        offline = {} if start.online is None else {
            c: "offline when selected (system: the algorithm's select() chose a client outside ServerAlgorithm.online)"
            for c in selected if c not in set(start.online)}
        reachable = [c for c in selected if c not in offline]
        payloads = rt.server.configure(rnd, reachable)
        rt.progress.round_started(rnd, list(payloads))
        for observer in rt.observers:
            observer.on_configure(rnd, payloads)
        if not rt.transport.secure_round(rnd, reachable, payloads, out):
            self.train_round(rnd, reachable, payloads, out)
        if offline:
            for cid, why in offline.items():
                log.warning("round %d: client %d failed: %s", rnd, cid, why)
                out.rejected[cid] = why
                out.bytes_down[cid] = out.bytes_up[cid] = 0
            rt.server.observe_failures(rnd, offline)
        if out.clock is None:  # a transport whose round aggregates without showing the updates (SecAgg+)
            out.clock = rt.system.close(rnd, {c: (out.bytes_down[c], m, out.bytes_up[c]) for c, m in out.metas.items()},
                                        set(out.metas), start.waited_s)
        return {"clients": selected, **rt.system.row(out.clock)}

    def train_round(self, rnd: int, selected: list[int], payloads: dict[int, wire.Payload], out: RoundOutcome) -> None:
        """Send the payloads, collect and check the updates, aggregate the accepted ones (into ``out``)."""
        rt = self.rt
        updates: dict[int, wire.Payload] = {}
        tc = time.perf_counter()
        rt.dropped_in_real_time, rt.surplus_in_real_time = {}, set()
        results = rt.transport.run_clients(rnd, payloads)
        out.time_client_s = time.perf_counter() - tc
        for cid in selected:
            update, n_down, n_up, failure = results[cid]
            out.bytes_down[cid] = n_down
            out.bytes_up[cid] = n_up
            if failure is not None:
                out.rejected[cid] = failure
                log.warning("round %d: update of client %d rejected: %s", rnd, cid, failure)
            else:
                assert update is not None  # (a transport's result has an update or a failure)
                updates[cid] = update
        ta = time.perf_counter()
        accepted, refused = accept_updates(rt.server, rnd, updates)
        out.rejected.update(refused)
        out.clock = rt.system.close(rnd, {c: (out.bytes_down[c], u.meta, out.bytes_up[c]) for c, u in updates.items()},
                                    set(accepted), self.round_start.waited_s)
        out.clock.timeline.dropped.update(rt.dropped_in_real_time)  # (already rejected: counted as the clock's)
        out.clock.timeline.surplus |= rt.surplus_in_real_time
        for cid, why in sorted(out.clock.timeline.dropped.items()):
            if cid in accepted:  # (a refused update keeps its reason)
                del accepted[cid]
                out.rejected[cid] = why
                log.warning("round %d: update of client %d dropped: %s", rnd, cid, why)
        # (an over-selected client whose update came after the first K did not fail: it was not needed)
        rt.server.observe_failures(rnd, {c: r for c, r in out.rejected.items() if c not in out.clock.timeline.surplus})
        out.metas = {c: p.meta for c, p in accepted.items()}
        if len(accepted) >= rt.cfg.federation.min_replies:
            out.agg = rt.server.aggregate(rnd, accepted)
        else:
            out.failed = (f"{len(accepted)} of {len(selected)} updates accepted, federation.min_replies is "
                          f"{rt.cfg.federation.min_replies}")
        out.time_aggregation_s = time.perf_counter() - ta
