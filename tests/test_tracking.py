"""Experiment tracking (runtime.loggers): what TensorBoard, MLflow and W&B received, read back with each
library's own reader, for a whole run and for a run resumed after a crash."""

import glob
import json
from pathlib import Path

import pytest
from helpers import crash_at_round, crash_in_checkpoint, tiny_config

from fedpeft import tracking
from fedpeft.config import ConfigError
from fedpeft.errors import UserError
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.runtime.embedded import EmbeddedRuntime

LOGGERS = "runtime.loggers=[tensorboard, mlflow, wandb]"


def tensorboard_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        out[tag] = {e.step: e.value for e in events}
        assert len(out[tag]) == len(events), f"{tag}: a round logged twice"
    return acc, out


def tensorboard_hparams(acc):
    """The hyperparameters of the run's HParams session (tensorboard's own protobuf), name -> protobuf Value."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    meta = acc.SummaryMetadata("_hparams_/session_start_info")
    assert meta.plugin_data.plugin_name == "hparams"
    return dict(plugin_data_pb2.HParamsPluginData.FromString(meta.plugin_data.content).session_start_info.hparams)


def wandb_records(run_dir):
    """Every record of the run's offline W&B files, in order, by kind (wandb's datastore reader)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    out = {"history": [], "run": [], "summary": []}
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        store = datastore.DataStore()
        store.open_for_scan(path)
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind in out:
                out[kind].append(getattr(record, kind))
    return out


def mlflow_client(run_dir):
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    return MlflowClient(tracking_uri=state["tracking_uri"]), state["run_id"]


def expected_scalars(rows):
    """metric -> {round: value} as the trackers must have it (the numbers of metrics.jsonl)."""
    out = {}
    for row in rows:
        for key, value in tracking.scalars(row).items():
            out.setdefault(key, {})[row["round"]] = value
    return out


def check_tensorboard(run_dir, rows, cfg):
    acc, got = tensorboard_scalars(run_dir)
    want = expected_scalars(rows)
    assert set(got) == set(want)
    for key, by_round in want.items():
        assert got[key] == pytest.approx(by_round, rel=1e-6), key  # TensorBoard keeps float32
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"lr: {cfg.train.lr}" in config_text and "tiny-bert" in config_text
    hparams = tensorboard_hparams(acc)  # the HParams dashboard's copy of the config
    assert hparams["train.lr"].number_value == pytest.approx(cfg.train.lr)
    assert hparams["model.name"].string_value == "tiny-bert" and set(hparams) == set(tracking.flat_config(cfg))
    summary_text = acc.Tensors("summary/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert json.loads(summary_text.strip("`\njson"))["total_bytes"] == read_summary(run_dir)["total_bytes"]


def check_mlflow(run_dir, rows, cfg, *, repeated=()):
    client, run_id = mlflow_client(run_dir)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == str(cfg.train.lr) and run.data.params["model.name"] == "tiny-bert"
    for key, by_round in expected_scalars(rows).items():
        history = client.get_metric_history(run_id, key)
        last = {}
        for m in sorted(history, key=lambda m: m.timestamp):
            last[m.step] = m.value
        assert last == pytest.approx(by_round), key
        steps = sorted(m.step for m in history)
        assert steps == sorted([*by_round, *(r for r in repeated if r in by_round)]), key
    (run_dir / "mlflow_check").mkdir()
    downloaded = client.download_artifacts(run_id, "summary.json", str(run_dir / "mlflow_check"))
    summary = json.loads(Path(downloaded).read_text())
    assert summary["total_bytes"] == read_summary(run_dir)["total_bytes"]


def check_wandb(run_dir, rows, cfg, *, sessions=1):
    records = wandb_records(run_dir)
    assert len(records["run"]) == sessions and len({r.run_id for r in records["run"]}) == 1
    config = {item.key: json.loads(item.value_json) for item in records["run"][0].config.update}
    assert config["train"]["lr"] == cfg.train.lr and config["model"]["name"] == "tiny-bert"
    logged = {}
    for h in records["history"]:
        values = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in h.item}
        logged[values["round"]] = {k: v for k, v in values.items() if not k.startswith("_") and k != "round"}
    want = expected_scalars(rows)
    for key, by_round in want.items():
        assert {r: v[key] for r, v in logged.items() if key in v} == pytest.approx(by_round), key
    summary = {}
    for s in records["summary"]:
        summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in s.update})
    assert summary["total_bytes"] == read_summary(run_dir)["total_bytes"]


@pytest.mark.needs_data
def test_every_logger_receives_the_rows_the_config_and_the_summary(tmp_path):
    # under DP, so that the privacy spent (dp_epsilon) is among what each backend must receive
    cfg = tiny_config(LOGGERS, "eval.every=1", "algorithm.dp={noise_multiplier: 1.0, clipping_norm: 0.5}")
    EmbeddedRuntime(cfg, tmp_path / "run").run()
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [0, 1, 2]
    want = expected_scalars(rows)
    assert {"dp_epsilon", "eval_accuracy", "train_loss", "time_client_s"} <= set(want), sorted(want)
    check_tensorboard(tmp_path / "run", rows, cfg)
    check_mlflow(tmp_path / "run", rows, cfg)
    check_wandb(tmp_path / "run", rows, cfg)


@pytest.mark.needs_data
def test_a_resumed_run_continues_the_same_tracked_runs(tmp_path, monkeypatch):
    cfg = tiny_config(LOGGERS, "federation.rounds=3", "eval.every=1", "runtime.checkpoint_every=2")
    crashed = EmbeddedRuntime(cfg, tmp_path / "run")
    crash_at_round(crashed, monkeypatch, 3)  # rounds 1, 2 logged; the checkpoint of round 2 is written
    with pytest.raises(KeyboardInterrupt):
        crashed.run()
    client, run_id = mlflow_client(tmp_path / "run")
    assert client.get_run(run_id).info.status == "FAILED"
    monkeypatch.undo()
    EmbeddedRuntime.resume(tmp_path / "run").run()
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    check_tensorboard(tmp_path / "run", rows, cfg)
    check_mlflow(tmp_path / "run", rows, cfg)
    assert mlflow_client(tmp_path / "run")[1] == run_id
    check_wandb(tmp_path / "run", rows, cfg, sessions=2)


@pytest.mark.needs_data
def test_rounds_run_again_after_a_resume_are_hidden_or_kept_as_each_backend_does(tmp_path, monkeypatch):
    cfg = tiny_config("runtime.loggers=[tensorboard, mlflow]", "federation.rounds=3", "eval.every=1",
                      "runtime.checkpoint_every=2")
    crashed = EmbeddedRuntime(cfg, tmp_path / "run")
    crash_in_checkpoint(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        crashed.run()  # round 3's row is logged everywhere, its checkpoint never written
    monkeypatch.undo()
    EmbeddedRuntime.resume(tmp_path / "run").run()  # round 3 runs again
    rows = read_metrics(tmp_path / "run")
    check_tensorboard(tmp_path / "run", rows, cfg)  # TensorBoard: the purged first round 3 is gone
    check_mlflow(tmp_path / "run", rows, cfg, repeated=[3])  # MLflow: both, the later last


@pytest.mark.needs_data
def test_a_resume_that_starts_over_from_round_one_logs_round_zero_once(tmp_path, monkeypatch):
    cfg = tiny_config("runtime.loggers=[tensorboard]", "eval.every=1", "runtime.checkpoint_every=2")
    crashed = EmbeddedRuntime(cfg, tmp_path / "run")
    crash_at_round(crashed, monkeypatch, 2)  # rounds 0 and 1 logged, no checkpoint yet
    with pytest.raises(KeyboardInterrupt):
        crashed.run()
    monkeypatch.undo()
    EmbeddedRuntime.resume(tmp_path / "run").run()  # from round 0 again
    check_tensorboard(tmp_path / "run", read_metrics(tmp_path / "run"), cfg)


@pytest.mark.needs_data
def test_a_failing_backend_is_logged_and_the_run_goes_on(tmp_path, monkeypatch):
    from fedpeft.tracking.mlflow_tracker import MlflowTracker

    def down(self, rnd, row):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(MlflowTracker, "log_row", down)
    summary = EmbeddedRuntime(tiny_config("runtime.loggers=[mlflow]"), tmp_path / "run").run()
    assert summary["rounds"] == 2
    events = (tmp_path / "run" / "events.log").read_text()
    assert events.count("the mlflow tracker failed to log a metrics row (ConnectionError") == 1
    client, run_id = mlflow_client(tmp_path / "run")
    assert client.get_run(run_id).info.status == "FINISHED"  # the summary still reached it


def test_every_number_of_a_row_is_tracked_numpy_scalars_included():
    import numpy as np

    row = {"round": 3, "loss": np.float32(0.5), "steps": np.int64(7), "stopped": np.bool_(True), "n": 2, "ok": False,
           "per_client": {"0": 1.0}, "clients": [0, 1], "note": "text", "missing": None}
    assert tracking.scalars(row) == {"loss": 0.5, "steps": 7.0, "stopped": 1.0, "n": 2.0, "ok": 0.0}


def test_the_tracked_config_masks_a_password():
    cfg = tiny_config("runtime.tracking.mlflow_tracking_uri=postgresql://ann:secret@db:5432/mlflow")
    flat = tracking.flat_config(cfg)
    assert flat["runtime.tracking.mlflow_tracking_uri"] == "postgresql://ann:***@db:5432/mlflow"
    assert "secret" not in json.dumps(tracking.tracked_config(cfg))


def test_a_missing_extra_and_a_repeated_logger_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match="names wandb more than once"):
        tiny_config("runtime.loggers=[wandb, wandb]")
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    with pytest.raises(tracking.TrackerUnavailable, match=r"mlflow needs the mlflow package.*pip install "
                       r"'fedpeft\[mlflow\]'"):
        tracking.check_available(["tensorboard", "mlflow"])
    with pytest.raises(UserError, match="fedpeft\\[mlflow\\]"):
        EmbeddedRuntime(tiny_config("runtime.loggers=[mlflow]"), None)


def test_the_documented_mlflow_ui_command_resolves_with_the_mlflow_extra():
    """docs/guide/tracking.md's `mlflow ui` line: the `mlflow` console script the extra installs loads, parses the
    line's arguments into its `ui` command, and the tracking server that command starts imports (mlflow-skinny
    lacks it: flask). Nothing is started."""
    import importlib
    import re
    import shlex
    from importlib.metadata import entry_points

    import click

    doc = (Path(__file__).parents[1] / "docs" / "guide" / "tracking.md").read_text()
    block = doc.split("```bash\n", 1)[1].split("```", 1)[0]  # the page's command block
    line = re.search(r"mlflow ui --[^\n`]*", block).group(0)
    argv = shlex.split(line.replace("RUN_DIR", "/tmp/run"))
    scripts = entry_points(group="console_scripts", name=argv[0])  # mlflow and mlflow-skinny both declare it
    assert len({script.value for script in scripts}) == 1
    cli = next(iter(scripts)).load()
    ctx = click.Context(cli, info_name=argv[0])
    command = cli.get_command(ctx, argv[1])  # mlflow's group maps ui to its server command
    assert command is not None and command.name in ("ui", "server")
    sub = command.make_context(argv[1], argv[2:], parent=ctx)
    assert sub.params["backend_store_uri"] == "sqlite:////tmp/run/mlflow.db"
    importlib.import_module("mlflow.server")  # what the command imports before it serves
    importlib.import_module("mlflow.server.handlers")
