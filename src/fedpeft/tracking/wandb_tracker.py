"""Weights & Biases: one W&B run per fedpeft run, offline by default (files under RUN_DIR/wandb, no account
needed; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads them later) or online
(runtime.tracking.wandb_mode). The config is the run's config, every number of a metrics row is logged with
its round, which is the x axis of every chart (W&B's own step only counts calls), and the summary goes to the
run's summary. A resumed run continues under the same W&B run id (online: W&B's resume; offline: the resumed
session writes a second offline-run directory with that id); the rounds it runs again are logged again."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from fedpeft.config import RunConfig
from fedpeft.tracking.base import Tracker


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, cfg: RunConfig, run_dir: Path, saved: dict[str, Any] | None, *, start_round: int):
        super().__init__(cfg, run_dir, saved, start_round=start_round)
        import wandb

        from fedpeft.tracking import tracked_config

        self.run_id = saved["run_id"] if saved else uuid.uuid4().hex[:12]  # W&B run ids: [a-z0-9]
        mode = cfg.runtime.tracking.wandb_mode
        self.run = wandb.init(
            project=cfg.runtime.tracking.project or cfg.name, name=run_dir.name, id=self.run_id,
            resume="allow" if mode == "online" else None,
            dir=str(run_dir), mode=mode, config=tracked_config(cfg),
            reinit="create_new", settings=wandb.Settings(silent=True, console="off", save_code=False))
        self.run.define_metric("round")
        self.run.define_metric("*", step_metric="round")

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def log_row(self, rnd: int, row: dict[str, Any]) -> None:
        from fedpeft.tracking import scalars

        self.run.log({"round": rnd, **scalars(row)})

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})

    def close(self) -> None:
        if getattr(self, "closed", False):
            return
        self.closed = True
        self.run.finish(exit_code=0 if self.finished else 1)
