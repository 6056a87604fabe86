"""What every experiment tracker does (see fedpeft.tracking)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from fedpeft.config import RunConfig
from fedpeft.observer import RunObserver

log = logging.getLogger("fedpeft")


class Tracker(RunObserver):
    """Sends a run to one tracking backend: the config when it opens, every metrics row (:meth:`log_row`), the
    summary (:meth:`log_summary`); :meth:`close` ends the tracked run (as failed when the run did not finish).
    A backend's failure while the run goes on is logged, once per kind of call, and never stops the run:
    metrics.jsonl and summary.json hold everything."""

    name: ClassVar[str]

    def __init__(self, cfg: RunConfig, run_dir: Path, saved: dict[str, Any] | None, *, start_round: int):
        """``saved``: what :meth:`state` returned for this run before a resume (None for a new run); rows from
        ``start_round`` on are (re)logged by this session."""
        self.finished = False
        self.failed: set[str] = set()

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to continue the same tracked run (kept in RUN_DIR/tracking.json)."""
        return {}

    def log_row(self, rnd: int, row: dict[str, Any]) -> None:
        """Send one metrics row."""

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Send the run's summary."""

    def close(self) -> None:
        """End the tracked run (safe to call twice)."""

    def _guarded(self, what: str, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as exc:  # noqa: BLE001 (any backend failure: the run goes on without it)
            if what not in self.failed:
                self.failed.add(what)
                log.warning("the %s tracker failed to %s (%s: %s); the run goes on, metrics.jsonl has every row",
                            self.name, what, type(exc).__name__, exc)

    def on_round_end(self, rnd: int, row: dict[str, Any]) -> None:
        self._guarded("log a metrics row", self.log_row, rnd, row)

    def on_run_end(self, summary: dict[str, Any]) -> None:
        self.finished = True
        self._guarded("log the summary", self.log_summary, summary)
