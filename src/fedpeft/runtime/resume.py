"""Where a run continues: its saved config (with more rounds, to extend it) and its last checkpoint.

Kept apart from the runtimes (no torch), so that a launcher can check a run before starting one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedpeft import checkpoint
from fedpeft.config import ConfigError, RunConfig, apply_overrides, validate_config
from fedpeft.config.load import read_yaml
from fedpeft.rundir import (
    CONFIG_FILE,
    config_digest,
    read_metrics,
    read_saved_config,
    read_summary,
    seal_saved_config,
)
from fedpeft.runlock import RunLock

log = logging.getLogger("fedpeft")


def resume_point(run_dir: str | Path, rounds: int, *,
                 allow_unsealed: bool = False) -> tuple[tuple[int, dict[str, Any]] | None, list[dict[str, Any]]]:
    """Where the run in RUN_DIR continues when resumed with federation.rounds = ``rounds``: (its checkpoint, the
    metrics rows up to it), or (None, []) when it has no checkpoint yet (it starts again from round 1 in place).
    A finished run continues only with more rounds than it ran, from the checkpoint of its last round.
    ``allow_unsealed``: accept a checkpoint without its seal (checkpoint.load)."""
    run_dir = Path(run_dir)
    finished = read_summary(run_dir)
    if finished:
        done = int(finished.get("rounds") or 0)
        if finished.get("stopped_early"):
            raise FileExistsError(f"the run in {str(run_dir)!r} stopped early after {done} rounds "
                                  f"({finished['stopped_early']}); more rounds would stop the same way")
        if rounds <= done:
            raise FileExistsError(
                f"the run in {str(run_dir)!r} has already finished ({done} rounds); to add rounds, resume it "
                f"with more: fedpeft run --resume {run_dir} --set federation.rounds={done + 10}")
    if not (run_dir / checkpoint.FILENAME).is_file():
        if finished:
            raise checkpoint.CheckpointError(
                f"the run in {str(run_dir)!r} has no checkpoint (runtime.checkpoint_every 0), so it cannot be "
                "extended; start a new run with the rounds you want")
        log.warning("%s has no checkpoint yet: the run starts again from round 1 in place", run_dir)
        return None, []
    restored = checkpoint.load(run_dir, allow_unsealed=allow_unsealed)  # a damaged one fails here, before any work
    check_config_unchanged(run_dir, *restored)
    if restored[0] > rounds:
        raise checkpoint.CheckpointError(
            f"the run in {str(run_dir)!r} has a checkpoint after round {restored[0]}, beyond federation.rounds "
            f"{rounds}; resume with at least that many rounds")
    kept = [r for r in read_metrics(run_dir) if r["round"] <= restored[0]]
    missing = sorted(set(range(1, restored[0] + 1)) - {r["round"] for r in kept})
    if missing:  # the rows of checkpointed rounds are written before their checkpoint: they were lost since
        raise checkpoint.CheckpointError(
            f"{run_dir / 'metrics.jsonl'} lacks the rows of round(s) {', '.join(map(str, missing[:5]))}, which the "
            f"checkpoint of round {restored[0]} follows: the file was damaged; restore it from a copy, or start the "
            "run again in a new directory")
    return restored, kept


def check_config_unchanged(run_dir: Path, rnd: int, state: dict[str, Any]) -> None:
    """Refuse a config.yaml whose settings (federation.rounds aside) differ from those the checkpoint of round
    ``rnd`` was saved with (its ``config_sha256``; checkpoints from before it was recorded are not checked)."""
    saved = state.get("config_sha256")
    if saved is None:
        return
    path = run_dir / CONFIG_FILE
    if config_digest(read_yaml(path) or {}) != saved:
        raise ConfigError(f"{path} differs from the config the checkpoint of round {rnd} was saved with (in more than "
                          "federation.rounds), so the run would not continue as it began; put the run's own config "
                          "back, or start a new run with this one")


def saved_config(run_dir: str | Path, overrides: Iterable[str] = (), *, plugins: Iterable[str] = (),
                 trust_plugins: bool = False, allow_unsealed: bool = False) -> RunConfig:
    """The config saved in RUN_DIR (checked: fedpeft.rundir.read_saved_config), with ``overrides`` applied. The
    plugins it lists are imported only with ``trust_plugins`` (or when ``plugins``, the user's, name them):
    reading a run directory never runs code it names (fedpeft.config.load.validate_config)."""
    path = Path(run_dir) / CONFIG_FILE
    raw = read_saved_config(run_dir, allow_unsealed=allow_unsealed)
    return validate_config(apply_overrides(raw, overrides), path.parent, plugins=plugins, trust_plugins=trust_plugins,
                           source=str(path))


def resume_config(run_dir: str | Path, rounds: int | None = None, *, allow_unsealed: bool = False) -> RunConfig:
    """The config saved in RUN_DIR, with federation.rounds set to ``rounds`` when given. Continuing a run runs its
    config, so the plugins it lists are imported. ``allow_unsealed``: a config.yaml and checkpoint written without
    their seal (by a fedpeft from before seals) are accepted and, once every check of the resume has passed,
    sealed in place (:func:`seal_older_files`), so that the run's own processes read sealed files."""
    overrides = [f"federation.rounds={rounds}"] if rounds is not None else []
    cfg = saved_config(run_dir, overrides, trust_plugins=True, allow_unsealed=allow_unsealed)
    if allow_unsealed:
        resume_point(run_dir, cfg.federation.rounds, allow_unsealed=True)  # the resume's checks, before any write
        seal_older_files(run_dir)
    return cfg


def seal_older_files(run_dir: str | Path) -> list[str]:
    """Seal RUN_DIR's config.yaml and checkpoint where they carry no seal (the user's opt-in, allow_unsealed),
    holding the run's lock, so that the run's own processes (a Flower ServerApp too) read them as sealed files.
    Returns what it did, one line each (also logged)."""
    run_dir = Path(run_dir)
    done = []
    lock = RunLock.acquire(run_dir)
    try:
        if seal_saved_config(run_dir):
            done.append(f"sealed {run_dir / CONFIG_FILE}, which carried no seal (allow_unsealed)")
        if checkpoint.seal_older(run_dir):
            done.append(f"sealed {run_dir / checkpoint.FILENAME}, which carried no seal (allow_unsealed)")
    finally:
        lock.release()
    for line in done:
        log.warning("%s", line)
    return done
