"""The virtual clock of a synchronous round: pure functions from each client's counted bytes and FLOPs and its
device to simulated seconds, and from the clients' arrivals to who is aggregated and when the round ends.

A client's time in a round is its download (latency + payload bytes / download bandwidth), its local computation
(counted FLOPs / the device's FLOP/s) and its upload (latency + update bytes / upload bandwidth). Nothing here
reads a host clock: the same run gives the same timeline on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fedpeft.system.devices import Devices


@dataclass(frozen=True)
class ClientTime:
    """One client's simulated seconds in one round."""

    download_s: float
    compute_s: float
    upload_s: float

    @property
    def total_s(self) -> float:
        return self.download_s + self.compute_s + self.upload_s


def transfer_s(num_bytes: int, bytes_per_s: float, latency_s: float) -> float:
    """Seconds to move ``num_bytes`` over a link (no time at all over an unlimited one without latency)."""
    return latency_s + (num_bytes / bytes_per_s if math.isfinite(bytes_per_s) else 0.0)


def client_time(devices: Devices, client: int, bytes_down: int, flops: float, bytes_up: int) -> ClientTime:
    """Client ``client``'s simulated seconds for a round that moved these bytes and counted these FLOPs."""
    return ClientTime(download_s=transfer_s(bytes_down, float(devices.download_bytes_per_s[client]),
                                            float(devices.latency_s[client])),
                      compute_s=flops / float(devices.flops_per_s[client]),
                      upload_s=transfer_s(bytes_up, float(devices.upload_bytes_per_s[client]),
                                          float(devices.latency_s[client])))


@dataclass
class RoundTimeline:
    """Who of a round's clients is aggregated, who is dropped and why, and how long the round took."""

    counted: list[int] = field(default_factory=list)  # aggregated, in order of arrival
    dropped: dict[int, str] = field(default_factory=dict)  # client -> why its update was not aggregated
    surplus: set[int] = field(default_factory=set)  # of those, arrived in time but after the first K: not failures
    duration_s: float = 0.0  # from the start of the training to the round's end (its waiting for clients aside)


def close_round(arrival_s: dict[int, float], online_for_s: dict[int, float], accepted: set[int], *,
                needed: int | None, deadline_s: float | None) -> RoundTimeline:
    """The timeline of a synchronous round whose clients would deliver their updates ``arrival_s`` seconds after
    its start (clients that failed before sending are not in it), each client staying online ``online_for_s``
    seconds from the start (inf: throughout). ``accepted``: the clients whose update passes the server's checks.
    ``needed``: aggregate the first this many accepted updates to arrive (over-selection), None: every one.

    A client that goes offline before its update arrives fails then; an update after ``deadline_s`` is late. The
    round ends when the needed updates are in, else when every client has delivered, gone or passed the deadline.
    """
    out = RoundTimeline()
    ends: list[float] = []
    arrived: list[tuple[float, int]] = []
    for client, at in arrival_s.items():
        gone = online_for_s.get(client, math.inf)
        if gone < at:
            out.dropped[client] = (f"went offline {gone:.3g} s (simulated) into the round, before its update arrived "
                                   f"at {at:.3g} s")
            ends.append(gone if deadline_s is None else min(gone, deadline_s))  # (the round waits no longer)
        elif deadline_s is not None and at > deadline_s:
            out.dropped[client] = (f"arrived {at:.3g} s (simulated) into the round, after system.deadline_s="
                                   f"{deadline_s:g}")
            ends.append(deadline_s)
        else:
            ends.append(at)
            if client in accepted:
                arrived.append((at, client))
    arrived.sort()
    if needed is not None and len(arrived) >= needed:
        out.counted = [c for _, c in arrived[:needed]]
        out.duration_s = arrived[needed - 1][0]
        for at, client in arrived[needed:]:
            out.surplus.add(client)
            out.dropped[client] = (f"arrived {at:.3g} s (simulated) into the round, after the first {needed} updates "
                                   "(system.over_selection)")
        return out
    out.counted = [c for _, c in arrived]
    out.duration_s = max(ends, default=0.0)
    return out
