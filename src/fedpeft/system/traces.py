"""Devices read from a trace file (``system.trace``): JSON or parquet, one device per client, never a pickle.

JSON: ``{"period_s": 86400, "devices": [{...}, ...]}``; parquet: one row per device, the same fields as columns
(``period_s`` then a column whose value is the same in every row, or absent). Per device:

* ``flops_per_s`` (FLOP/s the device trains at) or ``slowdown`` (how many times slower than the reference device
  of 1 TFLOP/s), one of the two;
* ``download_mbps``, ``upload_mbps`` (Mbit/s, > 0);
* ``latency_s`` (one way, seconds; default 0);
* ``online``: ``[[start_s, end_s], ...]`` windows when the device is online, or FedScale's ``active`` and
  ``inactive`` lists (the i-th window is ``[active[i], inactive[i])``); absent: always online. With ``period_s``
  the windows repeat every period (FedScale's traces wrap around), else a device is offline after its last one.

Every problem is one line naming the file, the device's index and the key, and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedpeft.errors import UserError
from fedpeft.system.devices import MBIT, REFERENCE_FLOPS_PER_S, Availability, Devices

log = logging.getLogger("fedpeft")
FIELDS = ("flops_per_s", "slowdown", "download_mbps", "upload_mbps", "latency_s", "online", "active", "inactive")


class TraceError(UserError):
    """A trace file fedpeft cannot use; the message names the file, the device and the key."""


def _read(path: Path) -> tuple[list[Any], Any]:
    """(the devices, period_s) as the file holds them."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise TraceError(f"{path}: not valid JSON ({exc}); write it as "
                             '{"period_s": 86400, "devices": [{"flops_per_s": ..., ...}]}') from None
        if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
            raise TraceError(f'{path}: the top level must be an object with a "devices" list (and optionally '
                             '"period_s"), e.g. {"devices": [{"flops_per_s": 2e10, "download_mbps": 20, '
                             '"upload_mbps": 5}]}')
        unknown = sorted(set(data) - {"devices", "period_s"})
        if unknown:
            raise TraceError(f"{path}: unknown top-level key {unknown[0]!r}; the keys are devices and period_s")
        return data["devices"], data.get("period_s")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 (pyarrow raises several types for a damaged file)
            raise TraceError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from None
        periods = {row.pop("period_s", None) for row in rows}
        if len(periods) > 1:
            raise TraceError(f"{path}: column period_s holds several values {sorted(map(str, periods))}; the "
                             "period is one for the whole trace")
        return rows, next(iter(periods), None)
    raise TraceError(f"{path}: a trace is a .json or .parquet file (a pickle, as FedScale ships, is never read: "
                     "convert it as docs/guide/system.md shows)")


def _number(path: Path, i: int, device: dict[str, Any], key: str, *, positive: bool, default: float | None = None
            ) -> float:
    value = device.get(key)
    if value is None:
        if default is not None:
            return default
        raise TraceError(f"{path}: device {i} has no {key}; give every device one")
    number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) and abs(value) < 1e300 \
        else math.nan  # (a JSON integer of 400 digits is no device's figure: refused, not overflowed)
    if not math.isfinite(number) or (number <= 0 if positive else number < 0):
        need = "a finite number > 0" if positive else "a finite number >= 0"
        raise TraceError(f"{path}: device {i}: {key} is {str(value)[:40]}; give {need}")
    return number


def _windows(path: Path, i: int, device: dict[str, Any], period: float | None) -> list[tuple[float, float]] | None:
    """The device's online windows, merged and checked (None: always online)."""
    if "online" in device and ("active" in device or "inactive" in device):
        raise TraceError(f"{path}: device {i} has both online and active/inactive windows; keep one")
    if "active" in device or "inactive" in device:
        active, inactive = device.get("active"), device.get("inactive")
        if active is None and inactive is None:  # (a parquet trace's null: always online, as a missing online)
            return None
        if not isinstance(active, list) or not isinstance(inactive, list) or len(active) != len(inactive):
            raise TraceError(f"{path}: device {i}: active and inactive must be lists of the same length (the i-th "
                             "window is [active[i], inactive[i]))")
        pairs: Any = list(zip(active, inactive))
    elif "online" in device:
        pairs = device["online"]
        if pairs is None:
            return None
    else:
        return None
    if not isinstance(pairs, list | tuple) or not pairs:
        raise TraceError(f"{path}: device {i}: online must be a non-empty list of [start_s, end_s] windows (leave it "
                         "out for a device that is always online)")
    out = []
    for j, pair in enumerate(pairs):
        ok = (isinstance(pair, list | tuple) and len(pair) == 2
              and all(isinstance(v, int | float) and not isinstance(v, bool) and abs(v) < 1e300 for v in pair))
        if not ok or not 0 <= pair[0] < pair[1]:
            raise TraceError(f"{path}: device {i}: window {j} is {pair!r}; give [start_s, end_s] with 0 <= start_s "
                             "< end_s")
        if period is not None and pair[1] > period:
            raise TraceError(f"{path}: device {i}: window {j} ends at {pair[1]:g} s, after period_s {period:g}; "
                             "split it at the period's end")
        out.append((float(pair[0]), float(pair[1])))
    merged: list[tuple[float, float]] = []
    for start, end in sorted(out):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def load_trace(path: str | Path, num_clients: int) -> Devices:
    """The devices of ``path`` for clients 0..num_clients-1: client c gets device c, or c modulo the number of
    devices when the trace holds fewer (said in the log, as FedScale maps clients to its traces)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"system.trace {str(path)!r} not found; give a .json or .parquet trace file "
                         "(docs/guide/system.md)")
    devices, period = _read(path)
    if not devices:
        raise TraceError(f"{path}: the trace holds no devices")
    if period is not None:
        if isinstance(period, bool) or not isinstance(period, int | float) or not 0 < period < 1e300:
            raise TraceError(f"{path}: period_s is {period!r}; give a number of seconds > 0, or leave it out")
        period = float(period)
    speed, down, up, latency = [], [], [], []
    owner: list[int] = []
    starts: list[float] = []
    ends: list[float] = []
    always = 0
    for i, device in enumerate(devices):
        if not isinstance(device, dict):
            raise TraceError(f"{path}: device {i} is {type(device).__name__}; each device is an object of fields")
        unknown = sorted(set(device) - set(FIELDS))
        if unknown:
            raise TraceError(f"{path}: device {i}: unknown key {unknown[0]!r}; the keys are "
                             f"{', '.join(f for f in FIELDS if f != 'period_s')}")
        has = [k for k in ("flops_per_s", "slowdown") if device.get(k) is not None]
        if len(has) != 1:
            raise TraceError(f"{path}: device {i} gives {' and '.join(has) or 'neither flops_per_s nor slowdown'}; "
                             "give exactly one of flops_per_s and slowdown")
        if has[0] == "flops_per_s":
            speed.append(_number(path, i, device, "flops_per_s", positive=True))
        else:
            speed.append(REFERENCE_FLOPS_PER_S / _number(path, i, device, "slowdown", positive=True))
        down.append(_number(path, i, device, "download_mbps", positive=True) * MBIT)
        up.append(_number(path, i, device, "upload_mbps", positive=True) * MBIT)
        latency.append(_number(path, i, device, "latency_s", positive=False, default=0.0))
        windows = _windows(path, i, device, period)
        if windows is None:
            always += 1
            windows = [(0.0, period if period is not None else math.inf)]
        for start, end in windows:
            owner.append(i)
            starts.append(start)
            ends.append(end)
    n = len(devices)
    index = np.arange(num_clients) % n
    if n < num_clients:
        log.info("system.trace %s holds %d devices for %d clients: client c gets device c mod %d", path, n,
                 num_clients, n)
    owners = np.asarray(owner, dtype=np.int64)
    # the windows of the clients, by client: client c's are device (c mod n)'s
    per_device = None
    if always < n:
        order = np.argsort(owners, kind="stable")
        per_device = np.split(order, np.searchsorted(owners[order], np.arange(1, n)))
    availability = None
    if per_device is not None:
        picks = [per_device[d] for d in index]
        clients = np.concatenate([np.full(len(p), c) for c, p in enumerate(picks)])
        take = np.concatenate(picks)
        availability = Availability(owner=clients.astype(np.int64), start=np.asarray(starts)[take],
                                    end=np.asarray(ends)[take], period_s=period, num_clients=num_clients)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Devices(np.asarray(speed)[index], np.asarray(down)[index], np.asarray(up)[index],
                   np.asarray(latency)[index], availability, f"trace {path} (sha256 {digest[:16]}...)", digest)
