"""The run's virtual clock (``system``): which clients are online when a round starts, each selected client's
simulated download, computation and upload, who of them is aggregated (deadline, over-selection, clients that
go offline) and the metrics row's simulated time. fedpeft.system holds the devices and the pure maths; this
module applies them to a round of the runtime.

A round starts when at least ``federation.min_replies`` clients are online (the clock waits for that), selects
among the online clients (``ServerAlgorithm.online``), and ends as fedpeft.system.clock.close_round says. The
server's own work (aggregation, evaluation) takes no simulated time.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from fedpeft.config import RunConfig
from fedpeft.errors import UserError
from fedpeft.system.clock import ClientTime, RoundTimeline, client_time, close_round
from fedpeft.system.devices import Devices, draw_profile
from fedpeft.system.traces import load_trace

log = logging.getLogger("fedpeft")


@dataclass
class RoundStart:
    """The clock at a round's start: who is online (None: everyone) and how long the round waited for them."""

    online: list[int] | None
    waited_s: float


@dataclass
class RoundClock:
    """A round's simulated time, as the metrics row gets it."""

    times: dict[int, ClientTime | None] = field(default_factory=dict)  # None: the client's work was not counted
    timeline: RoundTimeline = field(default_factory=RoundTimeline)
    waited_s: float = 0.0


def work_of(meta: Any) -> float | None:
    """The FLOPs a client's update says its training took (train_flops); None when it says none (FLOP counting
    off) or what it says is not a finite number >= 0 (a refused update's metadata may hold anything)."""
    value = meta.get("train_flops") if isinstance(meta, dict) else None
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number >= 0 else None


class SimulatedSystem:
    """The devices of the run's clients and the clock; ``now_s`` is checkpointed (``state``)."""

    def __init__(self, cfg: RunConfig, *, decides_rounds: bool = True):
        """``decides_rounds``: the clock applies system.deadline_s and over_selection; False: a runtime applies them
        in real time, and the clock only times the updates it aggregated."""
        system = cfg.system
        n = cfg.federation.num_clients
        seed = cfg.seed if system.seed is None else system.seed
        self.devices: Devices = load_trace(system.trace, n) if system.trace is not None else draw_profile(
            system.profile, n, seed)
        self.deadline_s = system.deadline_s if decides_rounds else None
        self.needed = cfg.federation.clients_per_round if system.over_selection and decides_rounds else None
        self.min_online = cfg.federation.min_replies
        self.now_s = 0.0
        self.uncounted_warned = system.simulates_time_only()  # (then nothing depends on it: no warning)
        self.trace_digest = self.devices.digest

    def describe(self) -> str:
        return self.devices.describe()

    def state(self) -> dict[str, Any]:
        return {"now_s": self.now_s, "trace_sha256": self.trace_digest}

    def load_state(self, state: dict[str, Any]) -> None:
        saved = state.get("trace_sha256", self.trace_digest)  # (a checkpoint from before the digest was kept)
        if saved != self.trace_digest:
            raise UserError(f"system.trace {self.devices.source}: the run started with a trace whose SHA-256 is "
                            f"{saved}, and the file now differs, so the devices would change mid-run; put the run's "
                            "trace back, or start a new run")
        self.now_s = float(state["now_s"])

    def round_start(self, rnd: int) -> RoundStart:
        """Wait (on the simulated clock) until enough clients are online; who they are."""
        availability = self.devices.availability
        if availability is None:
            return RoundStart(None, 0.0)
        start = availability.first_time_with(self.min_online, self.now_s)
        if start is None:
            raise RuntimeError(f"round {rnd}: the devices of {self.devices.source} never have "
                               f"federation.min_replies={self.min_online} clients online at once after simulated "
                               f"{self.now_s:.0f} s; lower federation.min_replies or give the trace longer online "
                               "windows")
        waited = start - self.now_s
        self.now_s = start
        online = [int(c) for c in availability.online(start).nonzero()[0]]
        return RoundStart(online, waited)

    def online_now(self) -> list[int] | None:
        """The clients online now (None: everyone, always)."""
        availability = self.devices.availability
        return None if availability is None else [int(c) for c in availability.online(self.now_s).nonzero()[0]]

    def online_for(self, client: int) -> float:
        availability = self.devices.availability
        return math.inf if availability is None else availability.online_for(client, self.now_s)

    def leaves_at(self, client: int) -> float:
        """When ``client``, online now, goes offline (inf: never), as an instant the availability agrees with."""
        availability = self.devices.availability
        return math.inf if availability is None else availability.leaves_at(client, self.now_s)

    def close(self, rnd: int, sent: dict[int, tuple[int, Any, int]], accepted: set[int],
              waited_s: float) -> RoundClock:
        """The round's clock from what each client moved and counted: ``sent`` maps a client that delivered an
        update to (bytes down, its update's meta, bytes up); ``accepted``: those passing the server's checks.
        Advances ``now_s`` to the round's end."""
        out = RoundClock(waited_s=waited_s)
        arrival: dict[int, float] = {}
        for client, (down, meta, up) in sent.items():
            work = work_of(meta)
            if work is None and not self.uncounted_warned:
                self.uncounted_warned = True
                log.warning("round %d: client %d's update counts no FLOPs (train_flops), so its computation takes no "
                            "simulated time and the round's simulated time is not reported", rnd, client)
            t = client_time(self.devices, client, down, work or 0.0, up)
            out.times[client] = t if work is not None else None
            arrival[client] = t.total_s
        online = {c: self.online_for(c) for c in arrival}
        out.timeline = close_round(arrival, online, accepted, needed=self.needed, deadline_s=self.deadline_s)
        self.now_s += out.timeline.duration_s
        return out

    def row(self, clock: RoundClock) -> dict[str, Any]:
        """The metrics row's simulated time: the round's seconds and the clock after it, and their split over the
        aggregated clients (mean download, computation, upload; waiting = for clients to come online and for the
        slower clients), which adds up to the round's seconds; per client its seconds to deliver."""
        span = clock.timeline.duration_s
        counted = [clock.times.get(c) for c in clock.timeline.counted]
        known = all(t is not None for t in clock.times.values())
        row: dict[str, Any] = {"sim_round_s": clock.waited_s + span if known else None,
                               "sim_time_s": self.now_s if known else None}
        means = {"download": 0.0, "compute": 0.0, "upload": 0.0}
        if counted and known:
            for part in means:
                means[part] = sum(getattr(t, f"{part}_s") for t in counted) / len(counted)
        row.update({f"sim_{part}_s": value if known else None for part, value in means.items()})
        row["sim_wait_s"] = clock.waited_s + span - sum(means.values()) if known else None
        row["sim_online_wait_s"] = clock.waited_s  # (of sim_wait_s: before the round could start)
        row["client_sim_s"] = {str(c): (t.total_s if t is not None else None) for c, t in clock.times.items()}
        row["sim_dropped"] = len(clock.timeline.dropped)
        return row


def replay(cfg: RunConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The simulated time of a finished synchronous run's rounds on ``cfg.system``'s devices and links, from the
    bytes and FLOPs its metrics rows counted per client: what each row's sim keys would have been had the run been
    started with that system. Exact only where the system changes no client's training, so it is refused for
    clients that come and go (the mobile profile, a trace with online windows), deadlines, over-selection and
    asynchronous runs (there the clock decides who trains: run them), for rows of such a run (an asynchronous
    aggregation, a round that waited for clients to come online or dropped updates) and for a round that rejected
    an update (its row keeps no count of that update's work)."""
    system, sim = cfg.system, SimulatedSystem(cfg)
    if sim.devices.availability is not None or system.deadline_s is not None or system.over_selection:
        raise UserError("replaying a run's rounds on other devices needs clients that are always online and rounds "
                        "that wait for every client (the clock then decides nothing about training); system "
                        f"{'trace' if system.trace is not None else 'profile ' + system.profile}, deadline_s "
                        f"{system.deadline_s}, over_selection {system.over_selection:g}: run the config with that "
                        "system instead")
    if cfg.federation.asynchronous is not None:
        raise UserError("replaying needs a synchronous run; an asynchronous schedule's clock decides which model "
                        "each client starts from: run the config with that system instead")
    out: list[dict[str, Any]] = []
    for row in rows:
        rnd = int(row["round"])
        if rnd == 0:
            out.append({"round": 0, "sim_time_s": 0.0})
            continue
        if "client_staleness" in row:
            raise UserError(f"round {rnd} is an asynchronous aggregation: a synchronous run's rows only can be replayed")
        if row.get("sim_online_wait_s") or row.get("sim_dropped"):
            raise UserError(f"round {rnd} waited for clients to come online or dropped updates: the run's own clock "
                            "decided who trained, so its rows cannot be replayed on other devices; run the config with "
                            "that system instead")
        if "client_flops" not in row:
            raise UserError(f"round {rnd}'s row has no client_flops (written by an older fedpeft): it cannot be "
                            "replayed; run the config again")
        if row.get("rejected"):
            raise UserError(f"round {rnd} rejected updates of clients {sorted(row['rejected'])}: its metrics row keeps "
                            "no count of their work, so its timeline cannot be replayed; run the config with that "
                            "system instead")
        flops, down, up = row["client_flops"], row["bytes_down"], row["bytes_up"]
        sent = {int(c): (int(down[c]), {"train_flops": flops[c]}, int(up[c])) for c in flops}
        clock = sim.close(rnd, sent, set(sent), 0.0)
        out.append({"round": rnd, **sim.row(clock)})
    return out
