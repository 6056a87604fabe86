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
      plots/             metric vs round, metric vs cumulative MB
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from fedpeft.config import RunConfig, dump_config


def new_run_dir(cfg: RunConfig, run_dir: str | Path | None = None) -> Path:
    if run_dir is not None:
        path = Path(run_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(cfg.output_dir) / f"{cfg.name}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = Path(cfg.output_dir) / f"{cfg.name}-{stamp}-{suffix}"
    if path.exists() and (path / "metrics.jsonl").exists():
        raise FileExistsError(f"run directory {str(path)!r} already holds a run; choose another --run-dir")
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


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, allow_nan=True).encode())


class RunWriter:
    def __init__(self, path: Path, cfg: RunConfig):
        self.path = path
        (path / "config.yaml").write_text(dump_config(cfg))
        self._metrics = open(path / "metrics.jsonl", "a", encoding="utf-8")
        self._handler = logging.FileHandler(path / "events.log", encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger("fedpeft").addHandler(self._handler)

    def partition(self, stats: dict[str, Any]) -> None:
        write_json(self.path / "partition.json", stats)

    def row(self, row: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        write_json(self.path / "summary.json", summary)

    def close(self) -> None:
        self._metrics.close()
        logging.getLogger("fedpeft").removeHandler(self._handler)
        self._handler.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl. A last line without its newline that is not JSON is a row cut off by a
    crash: it is left out with a warning (a resumed run writes that round again)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is not a run directory (no metrics.jsonl)")
    lines = path.read_text(encoding="utf-8").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                logging.getLogger("fedpeft").warning("%s: left out a last row cut off mid-write (%d characters)",
                                                     path, len(line))
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON; the file is damaged") from None
    return rows


def rewrite_metrics(run_dir: str | Path, rows: list[dict[str, Any]]) -> None:
    """Replace metrics.jsonl with these rows, atomically (used when a run resumes from a checkpoint)."""
    atomic_write(Path(run_dir) / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}
