"""The run directory: everything a run leaves behind, written as it goes.

::

    RUN_DIR/
      config.yaml        resolved configuration (every option, defaults included)
      partition.json     client sizes and label histograms
      metrics.jsonl      one JSON row per round (round 0 = initial evaluation)
      events.log         warnings and rejected updates
      summary.json       final / best metrics, rounds and time to target, totals
      checkpoint.safetensors  server state after the last completed round (fedpeft.checkpoint)
      adapter/           the final global adapter (HF PEFT format for peft-backed methods)
      best_adapter/      the global adapter of the best evaluated round (eval.save_best)
      .fedpeft.lock      held by the process writing the directory (fedpeft.runlock)
      plots/             metric vs round, metric vs cumulative MB
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedpeft.config import RunConfig, dump_config


def holds_run(path: Path) -> bool:
    return (path / "metrics.jsonl").exists() or (path / "config.yaml").exists()


def check_run_dir_free(run_dir: str | Path | None) -> None:
    """Refuse, before any work, a chosen run directory that already holds a run (a new run would mix with it)."""
    if run_dir is not None and holds_run(Path(run_dir)):
        raise FileExistsError(f"run directory {str(run_dir)!r} already holds a run; continue it with fedpeft run "
                              f"--resume {run_dir} (it restarts from round 1 when it has no checkpoint yet), or "
                              "choose another --run-dir")


def new_run_dir(cfg: RunConfig, run_dir: str | Path | None = None) -> Path:
    """Create the run directory (OUTPUT_DIR/NAME-TIMESTAMP unless given). Called once the run's data and model
    have loaded, so that a run refused on its inputs leaves no directory behind."""
    check_run_dir_free(run_dir)
    if run_dir is not None:
        path = Path(run_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(cfg.output_dir) / f"{cfg.name}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = Path(cfg.output_dir) / f"{cfg.name}-{stamp}-{suffix}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file, flush it to disk, rename it over ``path``: a reader (or a run resumed
    after a crash) sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN / infinite floats as None (JSON null) and numpy scalars and arrays as Python numbers
    and lists, in nested dicts, lists and tuples too: what strict JSON can hold."""
    if isinstance(obj, (np.ndarray, np.generic)):
        obj = obj.tolist()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def to_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON (no NaN / Infinity tokens, which are not JSON): non-finite numbers are written as null."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, to_json(obj, indent=2).encode())


class RunWriter:
    def __init__(self, path: Path, cfg: RunConfig):
        self.path = path
        (path / "config.yaml").write_text(dump_config(cfg))
        self._metrics = open(path / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (held open for the whole run)
        self._handler = logging.FileHandler(path / "events.log", encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger("fedpeft").addHandler(self._handler)

    def note(self, message: str) -> None:
        """An informational line in events.log, whatever the logging level."""
        record = logging.LogRecord("fedpeft", logging.INFO, __file__, 0, message, None, None)
        self._handler.handle(record)

    def partition(self, stats: dict[str, Any]) -> None:
        write_json(self.path / "partition.json", stats)

    def row(self, row: dict[str, Any]) -> None:
        self._metrics.write(to_json(row) + "\n")  # the row in memory keeps its floats; null on disk
        self._metrics.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        write_json(self.path / "summary.json", summary)

    def close(self) -> None:
        """Close metrics.jsonl and events.log (safe to call twice)."""
        self._metrics.close()
        logging.getLogger("fedpeft").removeHandler(self._handler)
        self._handler.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl. A last line without its newline that is not JSON is a row cut off by a
    crash: it is left out with a warning (a resumed run writes that round again). Files written before
    non-finite numbers were written as null hold NaN / Infinity tokens: they are read as None, as null is."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a run directory (no metrics.jsonl)")
    lines = path.read_text(encoding="utf-8").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line, parse_constant=lambda _: None))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                logging.getLogger("fedpeft").warning("%s: left out a last row cut off mid-write (%d characters)",
                                                     path, len(line))
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON; the file is damaged") from None
    return rows


def rewrite_metrics(run_dir: str | Path, rows: list[dict[str, Any]]) -> None:
    """Replace metrics.jsonl with these rows, atomically (used when a run resumes from a checkpoint)."""
    atomic_write(Path(run_dir) / "metrics.jsonl", "".join(to_json(r) + "\n" for r in rows).encode())


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}
