"""Watching a run from inside its process: the :class:`RunObserver` hooks that the embedded runtime calls
and that experiment trackers (``fedpeft.tracking``) implement."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedpeft.wire import Payload


class RunObserver:
    """Watches a run from inside its process (the embedded runtime): subclass it, override what you need and
    pass instances to ``fedpeft.run(config, observers=[...])``. Observers read; they must not change what
    they are given."""

    def on_configure(self, rnd: int, payloads: dict[int, Payload]) -> None:
        """What the server sends each selected client in round ``rnd`` (before encoding)."""

    def on_client_report(self, rnd: int, client_id: int, name: str, value: Any) -> None:
        """A value a client half reported with ``ctx.report(name, value)`` (e.g. headprune's "importance")."""

    def on_round_end(self, rnd: int, row: dict[str, Any]) -> None:
        """A copy of the round's metrics row once it is appended to metrics.jsonl (round 0: the initial
        evaluation)."""

    def on_run_end(self, summary: dict[str, Any]) -> None:
        """A copy of the run's summary once summary.json is written (not called for a run that failed)."""
