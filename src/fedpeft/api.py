"""The functions behind ``import fedpeft`` that compose several layers: running and resuming a run in the
runtime its config names, and reading a run's partition."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedpeft.config import RunConfig, load_config, validate_config
from fedpeft.observer import RunObserver


def _as_config(config: RunConfig | dict[str, Any] | str | Path) -> RunConfig:
    """The config to run: running a config runs the plugins it lists, as ``fedpeft run CONFIG`` does."""
    if isinstance(config, RunConfig):  # the cross-checks of a whole config, again
        return validate_config(config.model_dump(mode="json"), trust_plugins=True)
    if isinstance(config, dict):
        return validate_config(config, trust_plugins=True)
    return load_config(config, trust_plugins=True)


def run(config: RunConfig | dict[str, Any] | str | Path, run_dir: str | Path | None = None, *,
        observers: Sequence[RunObserver] = ()) -> dict[str, Any]:
    """Run a federated fine-tuning (a RunConfig, a mapping as in YAML, or a YAML path; its ``plugins`` are
    imported: a config is code) in the runtime its ``runtime.name`` names (see fedpeft.launchers.run_config),
    then draw RUN_DIR/plots; returns the run's summary (also in RUN_DIR/summary.json). ``observers`` (fedpeft.RunObserver) watch the run's rounds; a runtime that
    runs in this process only (embedded, not flower)."""
    from fedpeft.launchers import run_config

    return plotted(run_config(_as_config(config), run_dir, observers=observers))


def plotted(summary: dict[str, Any]) -> dict[str, Any]:
    """Draw the plots of the run ``summary`` describes; a plotting problem is logged, never fatal."""
    try:
        from fedpeft.report.plots import write_run_plots

        write_run_plots(summary["run_dir"])
    except Exception as exc:  # noqa: BLE001 (a plot must not fail a finished run)
        logging.getLogger("fedpeft").warning("plots not written: %s", exc)
    return summary


def resume(run_dir: str | Path, *, rounds: int | None = None, observers: Sequence[RunObserver] = (),
           allow_unsealed: bool = False) -> dict[str, Any]:
    """Continue the run in ``run_dir`` from its last checkpoint (``rounds``: a new federation.rounds, which
    also extends a finished run); returns its summary. The run's config is run, its plugins included.
    ``observers`` as in :func:`run`. ``allow_unsealed``: accept (and seal) a config.yaml and checkpoint saved
    without their SHA-256 seal, by a fedpeft from before seals."""
    from fedpeft.launchers import run_config
    from fedpeft.runtime.resume import resume_config

    cfg = resume_config(run_dir, rounds, allow_unsealed=allow_unsealed)
    return plotted(run_config(cfg, run_dir, resume=True, observers=observers))


def read_partition(run_dir: str | Path) -> dict[str, Any]:
    """RUN_DIR/partition.json: client sizes and label histograms."""
    path = Path(run_dir) / "partition.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a run directory (no partition.json)")
    partition: dict[str, Any] = json.loads(path.read_text())
    return partition
