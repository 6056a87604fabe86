"""Plots of one run or several: a metric against rounds, cumulative MiB (up + down), cumulative upload MiB and
simulated time (the system's virtual clock, for runs that have one)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib
import yaml

from fedpeft.durable import atomic_write
from fedpeft.metrics.accounting import metric_key

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# x axes: (file name suffix, label, title word, row key, scale)
X_AXES = (
    ("round", "round", "round", "round", 1.0),
    ("mb", "cumulative communication (MiB, up + down)", "communication", "cum_bytes", 2.0**-20),
    ("upload_mb", "cumulative upload (MiB)", "upload", "cum_bytes_up", 2.0**-20),
    ("sim_time", "simulated time (s, system clock)", "simulated time", "sim_time_s", 1.0),
)


class Plot(NamedTuple):
    path: Path
    title: str


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: Sequence[dict[str, Any]], metric: str, x_key: str = "round") -> tuple[list[float], list[float]]:
    """(x, metric) of the rows that hold a finite value of both; null / NaN values are left out."""
    key = metric_key(metric)
    pts = [(r[x_key], r[key]) for r in rows if finite(r.get(key)) and finite(r.get(x_key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def line_styles(n: int) -> list[dict[str, Any]]:
    """``n`` distinct line styles: 10 colours, then the same colours with other dashes; every run its own marker
    shape, and each run drawn thinner and with smaller markers than the one before, so that a run lying on top of
    another leaves the one below visible around it."""
    colors = plt.get_cmap("tab10").colors
    dashes = ("-", "--", ":", "-.")
    markers = ("o", "s", "^", "D", "v", "P", "X")
    shrink = [1.0 - 0.6 * i / max(1, n - 1) for i in range(n)]  # 1 for the first run drawn, 0.4 for the last
    return [{"color": colors[i % 10], "linestyle": dashes[(i // 10) % len(dashes)], "marker": markers[i % len(markers)],
             "linewidth": 0.8 + 2.2 * shrink[i], "markersize": 2.5 + 5.0 * shrink[i]} for i in range(n)]


def overlapping(curves: dict[str, tuple[list[float], list[float]]], tolerance: float = 0.005) -> dict[str, str]:
    """Runs whose curve lies on an earlier run's (the same x values, every y within ``tolerance`` of the y range
    of all the curves): label -> the label of the run it hides under."""
    spans = [y for _, ys in curves.values() for y in ys]
    gap = tolerance * ((max(spans) - min(spans)) if spans else 0.0) or 1e-12
    out: dict[str, str] = {}
    labels = list(curves)
    for j, label in enumerate(labels):
        xs, ys = curves[label]
        for earlier in labels[:j]:
            ex, ey = curves[earlier]
            if ex == xs and all(abs(a - b) <= gap for a, b in zip(ey, ys)):
                out[label] = out.get(earlier, earlier)
                break
    return out


def plot_curves(runs: dict[str, Sequence[dict[str, Any]]], metric: str, out_dir: Path, prefix: str = "",
                about: str = "") -> list[Plot]:
    """``metric`` of each run that has it against rounds, cumulative MiB, cumulative upload MiB and simulated time
    (when a run has it), one PNG per x axis, titled "<metric> vs <x>" (+ ``about``, e.g. the dataset and model); returns the files and their titles
    (none when no run has a finite value of ``metric``). Runs without one are not drawn; every drawn run has a style of its own, and beyond a
    few runs the legend sits to the right of the axes."""
    having = {label: rows for label, rows in runs.items() if series(rows, metric)[0]}
    if not having:  # no run has a finite value of it: nothing to draw
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    styles = line_styles(len(having))
    outside = len(having) > 6
    written = []
    for x_name, x_label, x_word, x_key, scale in X_AXES:
        if not any(series(rows, metric, x_key)[0] for rows in having.values()):
            continue  # (runs from before the simulated clock have no sim_time_s)
        title = f"{metric} vs {x_word}" + (f" ({about})" if about else "")
        columns = 1 + len(having) // 25
        width = 6 + (2.6 * columns if outside else 0)
        fig, ax = plt.subplots(figsize=(width, max(4, 0.2 * len(having) / columns + 1) if outside else 4))
        curves = {label: series(rows, metric, x_key) for label, rows in having.items()}
        under = overlapping(curves)
        for (label, (xs, values)), style in zip(curves.items(), styles):
            shown = f"{label} (overlaps {under[label]})" if label in under else label
            ax.plot([x * scale for x in xs], values, label=shown, **style)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x_label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if outside:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=columns, frameon=False)
        elif len(having) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}{metric}_vs_{x_name}.png"
        try:  # into a temporary file renamed into place: a cut-off write leaves the old plot
            atomic_write(path, lambda fh, fig=fig, title=title: fig.savefig(fh, format="png", dpi=120,
                                                                            metadata={"Title": title}))
        finally:
            plt.close(fig)
        written.append(Plot(path, title))
    return written


def describe_run(run_dir: Path) -> str:
    """A run's dataset and model ("sst2, tiny-bert"), from its config.yaml; empty if it has none."""
    path = Path(run_dir) / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.is_file() else None
    if not isinstance(cfg, dict):
        return ""
    names = [(cfg.get(section) or {}).get(key) for section, key in (("task", "dataset"), ("model", "name"))]
    return ", ".join(str(n) for n in names if n)


def plot_run(run_dir: Path, rows: Sequence[dict[str, Any]], metric: str) -> list[Plot]:
    """RUN_DIR/plots: the primary metric and, when the run has trained, the training loss."""
    runs = {Path(run_dir).name: rows}
    about = describe_run(run_dir)
    written = plot_curves(runs, metric, Path(run_dir) / "plots", about=about)
    if metric != "train_loss" and any(finite(r.get("train_loss")) for r in rows):
        written += plot_curves(runs, "train_loss", Path(run_dir) / "plots", about=about)
    return written


def write_run_plots(run_dir: str | Path) -> list[Plot]:
    """RUN_DIR/plots of a finished (or running) run, from its metrics.jsonl and primary metric. Called by
    ``fedpeft run`` and :func:`fedpeft.run` after a run; the runtimes draw nothing."""
    from fedpeft.rundir import read_metrics, read_summary

    metric = read_summary(run_dir).get("primary_metric") or "accuracy"
    return plot_run(Path(run_dir), read_metrics(run_dir), metric)
