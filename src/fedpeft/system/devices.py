"""Each client's device and link, and when it is online: drawn per client from a named profile and a seed, or
read from a trace (fedpeft.system.traces).

A profile draws every client's figures at once, as arrays (a few floats per client, however many clients), so a
run of 10,000 clients holds 10,000 x 6 numbers and nothing else per idle client. The figures and their sources
are in docs/guide/system.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

REFERENCE_FLOPS_PER_S = 1e12  # the ideal device: what the counted work of today's runs is timed at
DAY_S = 86_400.0
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class Availability:
    """Online windows ``[start, end)`` in seconds, per client, repeating every ``period_s`` (None: no repeat;
    after its last window a client stays offline). Held as flat arrays: window ``w`` belongs to client
    ``owner[w]``."""

    owner: np.ndarray  # int64 (W,)
    start: np.ndarray  # float64 (W,), within [0, period_s) when periodic
    end: np.ndarray  # float64 (W,), start < end <= period_s when periodic
    period_s: float | None
    num_clients: int

    def _phase(self, t: float) -> float:
        return t % self.period_s if self.period_s is not None else t

    def online(self, t: float) -> np.ndarray:
        """A boolean mask over the clients: online at simulated time ``t``."""
        return self._online_at_phase(self._phase(t))

    def _online_at_phase(self, phase: float) -> np.ndarray:
        inside = (self.start <= phase) & (phase < self.end)
        return np.bincount(self.owner[inside], minlength=self.num_clients) > 0

    def _settle(self, when: float, agrees: Callable[[np.ndarray], bool]) -> float:
        """``when``, moved up by the least floats needed for :meth:`online` at it to satisfy ``agrees`` (``t + delta``
        computed from a window's edge can land one rounding step before it)."""
        for _ in range(64):
            if agrees(self.online(when)):
                return when
            when = float(np.nextafter(when, math.inf))
        return when

    def online_for(self, client: int, t: float) -> float:
        """How long from ``t`` ``client`` stays online (0 when offline at ``t``; inf when it never leaves). A window
        that reaches the period's end goes on in the client's window from the period's start."""
        total = 0.0
        for _ in range(3):
            tt = self._phase(t + total)
            mine = (self.owner == client) & (self.start <= tt) & (tt < self.end)
            if not mine.any():
                return total
            end = float(self.end[mine].max())
            total += end - tt
            if self.period_s is None or end < self.period_s:
                return total
            if total >= self.period_s:
                return math.inf
        return math.inf

    def next_online(self, t: float, exclude: set[int] | frozenset[int] = frozenset()) -> float | None:
        """The earliest time from ``t`` at which a client not in ``exclude`` is online (None: never)."""
        excluded = np.zeros(self.num_clients, dtype=bool)
        excluded[list(exclude)] = True
        others = ~excluded[self.owner]
        tt = self._phase(t)
        if ((self.start <= tt) & (tt < self.end) & others).any():
            return t
        ahead = ((self.start - tt) % self.period_s if self.period_s is not None else self.start - tt)[others]
        ahead = ahead[ahead > 0]
        if not ahead.size:
            return None
        return self._settle(t + float(ahead.min()), lambda online: bool((online & ~excluded).any()))

    def leaves_at(self, client: int, t: float) -> float:
        """The first instant from ``t`` at which ``client`` is offline: ``t`` itself when it is offline then, inf when
        it never leaves; always an instant :meth:`online` agrees with."""
        stays = self.online_for(client, t)
        if stays == math.inf:
            return math.inf
        return self._settle(t + stays, lambda online: not online[client])

    def first_time_with(self, count: int, t: float) -> float | None:
        """The earliest time from ``t`` at which at least ``count`` clients are online (None: never)."""
        if int(self.online(t).sum()) >= count:
            return t
        tt = self._phase(t)
        # the count of clients online rises only at a window's start: try them in order, within one period
        if self.period_s is not None:
            ahead = (self.start - tt) % self.period_s
        else:
            ahead = self.start - tt
        order = np.argsort(ahead, kind="stable")
        for i in order:
            delta = float(ahead[i])
            if delta <= 0 and self.period_s is None:
                continue
            if int(self._online_at_phase(float(self.start[i])).sum()) >= count:
                return self._settle(t + delta, lambda online: int(online.sum()) >= count)
        return None


ALWAYS = None  # the availability of clients that are always online


@dataclass(frozen=True)
class Devices:
    """Per client (arrays indexed by client id): compute speed, link bandwidths and latency, availability."""

    flops_per_s: np.ndarray
    download_bytes_per_s: np.ndarray  # inf: transfers take no time
    upload_bytes_per_s: np.ndarray
    latency_s: np.ndarray  # paid once by every transfer (a round trip to set it up): the download and the upload
    availability: Availability | None  # None: always online
    source: str  # "profile ideal", "trace FILE (sha256 ...)": said in events.log
    digest: str | None = None  # a trace file's SHA-256 (a resume refuses a changed trace), None for a profile

    @property
    def num_clients(self) -> int:
        return len(self.flops_per_s)

    def describe(self) -> str:
        """One line for events.log: the source and the spread of the drawn figures."""

        def spread(values: np.ndarray, scale: float, unit: str) -> str:
            if not np.isfinite(values).all():
                return "unlimited"
            q = np.percentile(values, [5, 50, 95]) / scale
            return f"{q[1]:.3g} {unit} (5-95%: {q[0]:.3g}-{q[2]:.3g})"

        online = ("always online" if self.availability is None else
                  f"{self.availability.online(0.0).mean():.0%} online at the start")
        return (f"devices from {self.source}: compute {spread(self.flops_per_s, 1e9, 'GFLOP/s')}, download "
                f"{spread(self.download_bytes_per_s, MBIT, 'Mbit/s')}, upload "
                f"{spread(self.upload_bytes_per_s, MBIT, 'Mbit/s')}, latency {spread(self.latency_s, 1e-3, 'ms')}, "
                f"{online}")


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    return median * np.exp(sigma * rng.standard_normal(n))


def daily_windows(start: np.ndarray, length: np.ndarray) -> Availability:
    """One online window a day per client, ``start`` seconds after midnight for ``length`` seconds (a window past
    midnight continues the next day)."""
    n = len(start)
    start = np.where(length >= DAY_S, 0.0, start)  # online all day: one window, not two that touch
    length = np.minimum(length, DAY_S)
    end = start + length
    wraps = end > DAY_S
    owner = np.concatenate([np.arange(n), np.flatnonzero(wraps)])
    starts = np.concatenate([start, np.zeros(int(wraps.sum()))])
    ends = np.concatenate([np.minimum(end, DAY_S), end[wraps] - DAY_S])
    return Availability(owner=owner.astype(np.int64), start=starts, end=ends, period_s=DAY_S, num_clients=n)


def draw_profile(profile: str, num_clients: int, seed: int) -> Devices:
    """Every client's device from ``profile`` (``ideal``, ``datacenter``, ``mobile``), a pure function of the seed.
    The figures and their sources: docs/guide/system.md."""
    n = num_clients
    rng = np.random.default_rng([seed, 0x5157E4])
    if profile == "ideal":
        inf = np.full(n, math.inf)
        return Devices(np.full(n, REFERENCE_FLOPS_PER_S), inf, inf.copy(), np.zeros(n), None, "profile ideal")
    if profile == "datacenter":  # cross-silo: a data-centre GPU per client, wide-area links between regions
        return Devices(flops_per_s=_lognormal(rng, 5e13, 0.3, n),
                       download_bytes_per_s=np.minimum(_lognormal(rng, 1000 * MBIT, 0.5, n), 5000 * MBIT),
                       upload_bytes_per_s=np.minimum(_lognormal(rng, 1000 * MBIT, 0.5, n), 5000 * MBIT),
                       latency_s=rng.uniform(0.02, 0.15, n), availability=None, source="profile datacenter")
    if profile == "mobile":  # cross-device: phones on 4G, heavy-tailed speeds, one online window a day
        flops = _lognormal(rng, 5e10, 1.0, n)
        down = _lognormal(rng, 20 * MBIT, 0.8, n)
        up = _lognormal(rng, 6 * MBIT, 0.8, n)
        latency = _lognormal(rng, 0.055, 0.3, n)
        start = rng.uniform(0.0, DAY_S, n)
        length = _lognormal(rng, 3 * 3600.0, 0.7, n)
        return Devices(flops, down, up, latency, daily_windows(start, length), "profile mobile")
    raise ValueError(f"unknown system profile {profile!r}")
