"""TensorBoard: event files under RUN_DIR/tensorboard (torch.utils.tensorboard), one scalar per metric and round,
the config as text and as hyperparameters (the HParams dashboard), the summary as text. A resumed run writes
with ``purge_step`` at its first round, so TensorBoard hides what the interrupted session logged from there on
(those rounds run again)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedpeft.config import RunConfig, dump_config
from fedpeft.tracking.base import Tracker

LOG_DIR = "tensorboard"


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, cfg: RunConfig, run_dir: Path, saved: dict[str, Any] | None, *, start_round: int):
        super().__init__(cfg, run_dir, saved, start_round=start_round)
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        from fedpeft.tracking import flat_config

        resumed = saved is not None
        self.writer = SummaryWriter(log_dir=str(run_dir / LOG_DIR), purge_step=start_round if resumed else None)
        if not resumed:
            self.writer.add_text("config", f"```yaml\n{dump_config(cfg)}```", 0)
            experiment, start, end = hparams(flat_config(cfg), {})
            for summary in (experiment, start, end):
                self.writer.file_writer.add_summary(summary)

    def on_round_end(self, rnd: int, row: dict[str, Any]) -> None:
        from fedpeft.tracking import scalars

        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, rnd)
        self.writer.flush()

    def on_run_end(self, summary: dict[str, Any]) -> None:
        super().on_run_end(summary)
        self.writer.add_text("summary", f"```json\n{json.dumps(summary, indent=2, default=str)}\n```",
                             int(summary.get("rounds") or 0))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


TRACKER = TensorBoardTracker
