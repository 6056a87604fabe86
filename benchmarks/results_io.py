"""What every benchmark script shares: a description of the machine, the results file, a markdown table."""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch


def machine() -> str:
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads{gpu}"


def save(path: str | Path, results: dict[str, Any]) -> None:
    """Write the results as JSON, with the machine they were measured on."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"machine": machine(), **results}, indent=2))


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def is_finished_run(run_dir: Path, cfg: Any) -> bool:
    """True if ``run_dir`` holds a finished run of exactly ``cfg``; touches nothing."""
    from fedpeft.config import dump_config

    return (run_dir / "summary.json").exists() and (run_dir / "config.yaml").read_text() == dump_config(cfg)


def reuse_or_clear(run_dir: Path, cfg: Any, label: str) -> bool:
    """True if ``run_dir`` holds a finished run of exactly ``cfg`` (to be reused). Otherwise an unfinished run there
    is removed (it is trained again from scratch) and False is returned; a finished run of another config stops
    the script rather than being overwritten."""
    if is_finished_run(run_dir, cfg):
        print(f"[{label}] reusing {run_dir}", flush=True)
        return True
    if (run_dir / "summary.json").exists():
        raise SystemExit(f"{run_dir} holds a finished run with another config; move it away or pass --runs DIR")
    if run_dir.exists():
        print(f"[{label}] replacing the unfinished run in {run_dir}", flush=True)
        shutil.rmtree(run_dir)
    return False
