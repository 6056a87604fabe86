"""Side-by-side markdown table of several runs, from their run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

from fedpeft.report.plots import plot_curves
from fedpeft.rundir import read_metrics, read_summary

COLUMNS = (
    ("run", "run"),
    ("model", "model"),
    ("peft", "method"),
    ("algorithm", "algorithm"),
    ("clients", "N/K"),
    ("rounds", "rounds"),
    ("initial", "initial"),
    ("final", "final"),
    ("best", "best"),
    ("rounds_to_target", "rounds to target"),
    ("up_mib", "MiB up / client / round"),
    ("total_mib", "total MiB"),
    ("trainable", "trainable params"),
    ("wall_s", "wall s"),
)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def run_record(run_dir: Path) -> dict[str, Any]:
    summary = read_summary(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    fed = cfg.get("federation", {})
    return {
        "run": run_dir.name,
        "model": cfg.get("model", {}).get("name"),
        "peft": cfg.get("peft", {}).get("method"),
        "algorithm": cfg.get("algorithm", {}).get("name"),
        "clients": f"{fed.get('num_clients')}/{fed.get('clients_per_round')}",
        "rounds": summary.get("rounds"),
        "initial": summary.get("initial"),
        "final": summary.get("final"),
        "best": summary.get("best"),
        "rounds_to_target": summary.get("rounds_to_target"),
        "up_mib": (summary["mean_bytes_up_per_client_round"] / 2**20) if "mean_bytes_up_per_client_round" in summary else None,
        "total_mib": (summary["total_bytes"] / 2**20) if "total_bytes" in summary else None,
        "trainable": summary.get("trainable_parameters"),
        "wall_s": summary.get("wall_s"),
        "metric": summary.get("primary_metric") or "accuracy",
    }


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    metrics = sorted({r["metric"] for r in records})
    head = [label for _, label in COLUMNS]
    lines = [f"metric: {', '.join(metrics)}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        lines.append("| " + " | ".join(_fmt(r.get(key)) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None, metric: str | None = None) -> str:
    dirs = [Path(d) for d in run_dirs]
    records = []
    for d in dirs:
        if not (d / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{str(d)!r} is not a run directory (no metrics.jsonl)")
        records.append(run_record(d))
    table = markdown_table(records)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(table + "\n")
        chosen = metric or records[0]["metric"]
        plot_curves({d.name: read_metrics(d) for d in dirs}, chosen, out)
    return table
