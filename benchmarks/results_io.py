"""What every benchmark script shares: a description of the machine, the results file, a markdown table."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def save(path: str | Path, results: dict[str, Any]) -> None:
    """Write the results as JSON, with the machine they were measured on."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"machine": machine(), **results}, indent=2))


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
