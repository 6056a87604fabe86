"""MLflow: one MLflow run per fedpeft run, through MlflowClient (no global active run). By default the backend
is a SQLite database in the run directory (RUN_DIR/mlflow.db, artifacts in RUN_DIR/mlartifacts): MLflow 3
keeps its plain-file store only behind an opt-out, and recommends a database for local use;
runtime.tracking.mlflow_tracking_uri points elsewhere (a tracking server, a shared database). The config's
dotted keys are the run's parameters, every number of a metrics row a metric at step = round, the summary
an artifact (summary.json) and the run ends FINISHED, or FAILED when it stopped early. A resumed run
continues the same MLflow run; the rounds it runs again are logged again at the same steps (MLflow keeps
both values in the metric's history)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fedpeft.config import RunConfig
from fedpeft.tracking.base import Tracker

BATCH = 100  # MLflow's limit of parameters per log_batch call


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, cfg: RunConfig, run_dir: Path, saved: dict[str, Any] | None, *, start_round: int):
        super().__init__(cfg, run_dir, saved, start_round=start_round)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        from fedpeft.tracking import flat_config

        self.uri = cfg.runtime.tracking.mlflow_tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').absolute()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        if saved is not None and saved.get("tracking_uri") == self.uri:
            self.run_id = saved["run_id"]
            self.experiment_id = saved["experiment_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = cfg.runtime.tracking.project or cfg.name
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            self.experiment_id = experiment.experiment_id
        else:
            artifacts = (run_dir / "mlartifacts").absolute().as_uri() if cfg.runtime.tracking.mlflow_tracking_uri is None else None
            self.experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        self.run_id = self.client.create_run(self.experiment_id, run_name=run_dir.name).info.run_id
        params = [Param(k, str(v)) for k, v in flat_config(cfg).items()]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + BATCH])

    def state(self) -> dict[str, Any]:
        return {"tracking_uri": self.uri, "experiment_id": self.experiment_id, "run_id": self.run_id}

    def log_row(self, rnd: int, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        from fedpeft.tracking import scalars

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, rnd) for k, v in scalars(row).items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit of metrics per call
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self) -> None:
        if getattr(self, "closed", False):
            return
        self.closed = True
        self.client.set_terminated(self.run_id, status="FINISHED" if self.finished else "FAILED")
