"""Plots of one run or several: metric vs round and metric vs cumulative megabytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(rows: Sequence[dict[str, Any]], metric: str) -> tuple[list[int], list[float], list[float]]:
    key = f"eval_{metric}"
    pts = [(r["round"], r[key], r.get("cum_bytes", 0) / 2**20) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]


def plot_curves(runs: dict[str, Sequence[dict[str, Any]]], metric: str, out_dir: Path, prefix: str = "") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for x_name, x_label in (("round", "round"), ("mb", "cumulative communication (MiB, up + down)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, rows in runs.items():
            rounds, values, mbs = _series(rows, metric)
            ax.plot(rounds if x_name == "round" else mbs, values, marker="o", markersize=3, label=label)
        ax.set_xlabel(x_label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}{metric}_vs_{x_name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def plot_run(run_dir: Path, rows: Sequence[dict[str, Any]], metric: str) -> list[Path]:
    return plot_curves({Path(run_dir).name: rows}, metric, Path(run_dir) / "plots")
