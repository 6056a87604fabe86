"""What every experiment tracker does (see fedpeft.tracking)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from fedpeft.algorithms.base import RunObserver
from fedpeft.config import RunConfig


class Tracker(RunObserver):
    """Sends a run to one tracking backend: the config when it opens, every metrics row (on_round_end), the
    summary (on_run_end); :meth:`close` ends the tracked run (as failed when the run did not finish)."""

    name: ClassVar[str]

    def __init__(self, cfg: RunConfig, run_dir: Path, saved: dict[str, Any] | None, *, start_round: int):
        """``saved``: what :meth:`state` returned for this run before a resume (None for a new run); rows from
        ``start_round`` on are (re)logged by this session."""
        self.finished = False

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to continue the same tracked run (kept in RUN_DIR/tracking.json)."""
        return {}

    def on_run_end(self, summary: dict[str, Any]) -> None:
        self.finished = True

    def close(self) -> None:
        """End the tracked run (safe to call twice)."""
