"""TensorBoard: event files under RUN_DIR/tensorboard (torch.utils.tensorboard), one scalar per metric and round,
the config as text and as hyperparameters (the HParams dashboard), the summary as text. A resumed run writes
with ``purge_step`` at its first round, so TensorBoard hides what the interrupted session logged from there on
(those rounds run again)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from fedpeft.config import RunConfig
from fedpeft.tracking.base import Tracker

LOG_DIR = "tensorboard"


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, cfg: RunConfig, run_dir: Path, saved: dict[str, Any] | None, *, start_round: int):
        super().__init__(cfg, run_dir, saved, start_round=start_round)
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        from fedpeft.tracking import flat_config, tracked_config

        # a resumed run hides what the interrupted session logged from its first round on (from step 0, the
        # config included, when it starts over from round 1: round 0 is evaluated again)
        fresh = saved is None or start_round == 1
        purge = None if saved is None else (0 if start_round == 1 else start_round)
        self.writer = SummaryWriter(log_dir=str(run_dir / LOG_DIR), purge_step=purge)
        if fresh:
            self.writer.add_text("config", f"```yaml\n{yaml.safe_dump(tracked_config(cfg), sort_keys=False)}```", 0)
            experiment, start, end = hparams(flat_config(cfg), {})
            for summary in (experiment, start, end):
                self.writer.file_writer.add_summary(summary)

    def log_row(self, rnd: int, row: dict[str, Any]) -> None:
        from fedpeft.tracking import scalars

        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, rnd)
        self.writer.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", f"```json\n{json.dumps(summary, indent=2, default=str)}\n```",
                             int(summary.get("rounds") or 0))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
