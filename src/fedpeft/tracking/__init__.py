"""Experiment tracking (``runtime.loggers``): every metrics row, the resolved config and the summary of a run,
sent to TensorBoard, MLflow and/or Weights & Biases as the run goes.

A tracker is a :class:`fedpeft.RunObserver` the runtime adds to a run's observers; what it must keep to
continue the same tracked run after ``fedpeft run --resume`` (a run id) it keeps in RUN_DIR/tracking.json.
Each backend is an optional extra (``pip install 'fedpeft[tensorboard]'``, ``[mlflow]``, ``[wandb]``); a
config that names a missing one is refused before the model loads, with the command that installs it. A
plugin adds its own with ``fedpeft.register_tracker`` (see :mod:`fedpeft.tracking.backends`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from fedpeft.errors import UserError
from fedpeft.plugins import load_built_ins
from fedpeft.registry import resolve
from fedpeft.tracking.backends import TRACKERS, TrackerEntry, register_tracker

if TYPE_CHECKING:  # neither is imported here: the config's validation registers the built-in trackers
    from fedpeft.config import RunConfig
    from fedpeft.tracking.base import Tracker

log = logging.getLogger("fedpeft")
STATE_FILE = "tracking.json"


def __getattr__(name: str) -> Any:
    if name == "Tracker":  # the base class imports the config: only when asked for
        from fedpeft.tracking.base import Tracker

        return Tracker
    raise AttributeError(f"module 'fedpeft.tracking' has no attribute {name!r}")


class TrackerUnavailable(UserError, ImportError):
    """A logger of runtime.loggers whose package is not installed."""


def tracker_entry(name: str) -> TrackerEntry:
    """The registered tracker ``name`` (a one-line ConfigError listing the registered ones otherwise)."""
    load_built_ins()
    try:
        return TRACKERS.get(name)
    except ValueError as exc:
        from fedpeft.config import ConfigError

        raise ConfigError(str(exc)) from None


def check_available(names: list[str]) -> None:
    """Raise TrackerUnavailable (one line, with the install command) for a logger whose package is missing."""
    for name in names:
        entry = tracker_entry(name)
        if entry.package is not None and importlib.util.find_spec(entry.package) is None:
            raise TrackerUnavailable(f"runtime.loggers: {name} needs the {entry.package} package, which is not "
                                     f"installed: {entry.install_command()} (or remove {name} from runtime.loggers)")


def open_trackers(cfg: RunConfig, run_dir: Path, *, resume: bool, start_round: int) -> list[Tracker]:
    """The run's trackers, continuing the tracked runs named in RUN_DIR/tracking.json when ``resume``."""
    names = list(cfg.runtime.loggers)
    if not names:
        return []
    check_available(names)
    path = run_dir / STATE_FILE
    saved = json.loads(path.read_text()) if resume and path.is_file() else {}
    trackers: list[Tracker] = []
    try:
        for name in names:
            tracker = resolve(tracker_entry(name).tracker)
            trackers.append(tracker(cfg, run_dir, saved.get(name), start_round=start_round))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    from fedpeft.rundir import resume_hint, write_json

    try:
        write_json(path, {t.name: t.state() for t in trackers}, then=resume_hint(run_dir))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row (booleans as 0/1, NumPy scalars included); nested per-client entries and
    texts are left out."""
    out = {}
    for key, value in row.items():
        if key == "round" or value is None or isinstance(value, (dict, list, str)):
            continue
        if isinstance(value, (numbers.Real, np.bool_)):
            out[key] = float(value)
    return out


def redacted(uri: str) -> str:
    """``uri`` without the password of its user info (``scheme://user:***@host``)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def tracked_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as the trackers record it: a password in the MLflow tracking URI is masked."""
    data = cfg.model_dump(mode="json")
    uri = data["runtime"]["tracking"]["mlflow_tracking_uri"]
    if uri is not None:
        data["runtime"]["tracking"]["mlflow_tracking_uri"] = redacted(uri)
    return data


def flat_config(cfg: RunConfig) -> dict[str, Any]:
    """The tracked config as dotted keys (``train.lr``), values as str / int / float / bool (lists as JSON)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif value is None or isinstance(value, (list, tuple)):
            out[prefix] = json.dumps(value)
        else:
            out[prefix] = value

    walk("", tracked_config(cfg))
    return out


__all__ = ["Tracker", "TrackerEntry", "TrackerUnavailable", "check_available", "flat_config", "open_trackers",
           "register_tracker", "scalars", "tracked_config", "tracker_entry"]
