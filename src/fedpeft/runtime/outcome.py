"""What a transport returns for one client, and what a round's clients' work amounted to: the types a schedule and a
transport exchange (fedpeft.runtime.transport)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedpeft import wire
from fedpeft.runtime.simclock import RoundClock

# What one client returns for a round: (decoded update or None, bytes down, bytes up, failure reason or None)
ClientResult = tuple[wire.Payload | None, int, int, str | None]


@dataclass
class RoundOutcome:
    """What the clients' work of one round amounted to, before evaluation."""

    metas: dict[int, dict[str, Any]] = field(default_factory=dict)  # accepted clients -> their update's meta
    agg: dict[str, float] = field(default_factory=dict)  # aggregation metrics (empty if nothing was aggregated)
    rejected: dict[int, str] = field(default_factory=dict)  # client -> why its update was not aggregated
    bytes_down: dict[int, int] = field(default_factory=dict)
    bytes_up: dict[int, int] = field(default_factory=dict)
    time_client_s: float = 0.0
    time_aggregation_s: float = 0.0
    failed: str | None = None  # why the round aggregated nothing (too few updates), or None
    clock: RoundClock | None = None  # the round's simulated time (system), once the updates have been checked
