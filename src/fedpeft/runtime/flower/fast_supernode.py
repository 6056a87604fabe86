"""``flower-supernode`` with a shorter idle poll: the one place fedpeft changes Flower's behaviour.

Flower 1.41's SuperNode loop (``flwr.supernode.start_client_internal``) sleeps a literal 3 s whenever
the SuperLink has no message for it, and 0.5 s at a time while it waits for the ClientApp's reply;
neither is configurable. On loopback that fixed poll is most of what a round costs beyond training
(BENCHMARKS.md). This launcher runs Flower's own SuperNode entry point unchanged, except that the
``time`` module that loop sees sleeps at most ``--poll-interval`` seconds (default 0.1):

    python -m fedpeft.runtime.flower.fast_supernode --poll-interval 0.1 <flower-supernode arguments>

The cost is more requests: an idle SuperNode asks the SuperLink for work 1 / poll-interval times a
second instead of once every 3 s, so on a real network a larger interval (0.2-0.5 s) is kinder. It
depends on Flower internals, hence the pinned flwr==1.41.0 and a test (test_fast_supernode.py) that
fails if the patched loop changes.
"""

from __future__ import annotations

import argparse
import sys
import time as real_time
from types import ModuleType
from typing import Any

from fedpeft.runtime.flower.internals import run_flower_supernode, start_client_internal

DEFAULT_POLL_S = 0.1


class ShortSleepClock:
    """Stands in for the ``time`` module inside the SuperNode loop: ``sleep`` is capped, the rest is time's."""

    def __init__(self, cap_s: float, clock: ModuleType = real_time):
        self.cap_s = cap_s
        self._clock = clock

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(min(seconds, self.cap_s))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)


def patch(poll_s: float) -> None:
    """Make the SuperNode loop sleep at most ``poll_s`` seconds at a time (this process only)."""
    if not isinstance(getattr(start_client_internal, "time", None), (ModuleType, ShortSleepClock)):
        raise RuntimeError("flwr.supernode.start_client_internal no longer uses the time module: this launcher "  # noqa: TRY004
                           "is written for flwr==1.41.0")
    start_client_internal.time = ShortSleepClock(poll_s)  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_S)
    args, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.poll_interval <= 0:
        raise SystemExit("--poll-interval must be positive")
    patch(args.poll_interval)
    sys.argv = ["flower-supernode", *rest]
    run_flower_supernode()


if __name__ == "__main__":
    main()
