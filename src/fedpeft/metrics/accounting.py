"""Run-level accounting over metrics rows: targets, totals, transmission (paper 004, Eq. 1)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def metric_key(metric: str) -> str:
    """The metrics.jsonl key of a metric: ``train_loss`` and a personalized ``personal_<name>`` as they are, a
    global-model evaluation metric with ``eval_``."""
    return metric if metric == "train_loss" or metric.startswith("personal_") else f"eval_{metric}"


def better_or_equal(metric: str, value: float, target: float) -> bool:
    """Losses are reached from above, scores from below."""
    return value <= target if metric.endswith("loss") else value >= target


def first_reaching(rows: Sequence[dict[str, Any]], key: str, target: float) -> dict[str, Any] | None:
    for row in rows:
        value = row.get(key)
        if value is not None and better_or_equal(key, value, target):
            return row
    return None


def total_transmission(rounds: int, clients: int, payload_bytes: float) -> float:
    """Paper 004, Eq. 1: T = 2 * rounds * clients * C (upload + download of a C-byte model)."""
    return 2.0 * rounds * clients * payload_bytes


def personal_sample(row: dict[str, Any], key: str) -> dict[str, Any]:
    """For a personalized metric (``personal_<name>``): the rows and clients its value in ``row`` was scored on
    (``final_rows``, ``final_clients``) and, for accuracy, the 95% Wilson interval (``final_interval``); a
    headline from a few held-out rows a client is read with its sample size."""
    rows = row.get("personal_examples")
    if not key.startswith("personal_") or not isinstance(rows, int) or rows <= 0 or row.get(key) is None:
        return {}
    out: dict[str, Any] = {"final_rows": rows, "final_clients": len(row.get("client_personal") or {})}
    if key == "personal_accuracy" and math.isfinite(row[key]):
        from fedpeft.metrics.scores import accuracy_interval

        out["final_interval"] = list(accuracy_interval(row[key], rows))
    return out


def summarize(rows: Sequence[dict[str, Any]], *, metric: str, target: float | None) -> dict[str, Any]:
    key = metric_key(metric)
    evals = [r for r in rows if key in r]
    train_rows = [r for r in rows if r.get("round", 0) > 0 and "bytes_up" in r]
    out: dict[str, Any] = {"primary_metric": metric, "target": target}
    if evals:
        pick = min if metric.endswith("loss") else max
        # a NaN evaluation is never the best; rows read back from metrics.jsonl hold it as None (null)
        scored = [r for r in evals if r[key] is not None and math.isfinite(r[key])]
        best = pick(scored, key=lambda r: r[key]) if scored else {key: None, "round": None}
        out.update({
            "initial": evals[0][key] if evals[0]["round"] == 0 else None,
            "final": evals[-1][key],
            "final_round": evals[-1]["round"],
            "best": best[key],
            "best_round": best["round"],
            "final_eval": {k: v for k, v in evals[-1].items() if k.startswith(("eval_", "personal_"))
                           and k not in ("personal_examples",)},
        })
        out.update(personal_sample(evals[-1], key))
    hit = first_reaching(evals, key, target) if target is not None else None
    out["rounds_to_target"] = hit["round"] if hit else None
    out["time_to_target_s"] = hit["wall_s"] if hit else None
    out["sim_time_to_target_s"] = hit.get("sim_time_s") if hit else None
    if train_rows:
        ups = [b for r in train_rows for b in r["bytes_up"].values()]
        downs = [b for r in train_rows for b in r["bytes_down"].values()]
        out.update({
            "rounds": train_rows[-1]["round"],
            "total_bytes_up": sum(ups),
            "total_bytes_down": sum(downs),
            "total_bytes": sum(ups) + sum(downs),
            "mean_bytes_up_per_client_round": sum(ups) / max(len(ups), 1),
            "mean_bytes_down_per_client_round": sum(downs) / max(len(downs), 1),
            "total_flops": sum(r.get("flops") or 0.0 for r in train_rows),
            "total_ops_analytic": (None if any(r.get("ops_analytic", 0.0) is None for r in train_rows)
                                   else sum(r.get("ops_analytic") or 0.0 for r in train_rows)),
            "time_client_s": sum(r["time_client_s"] for r in train_rows),
            "time_aggregation_s": sum(r["time_aggregation_s"] for r in train_rows),
            "time_evaluation_s": sum(r["time_evaluation_s"] for r in rows),
            "time_overhead_s": sum(r["time_overhead_s"] for r in train_rows),
            "wall_s": rows[-1]["wall_s"],
            "rejected_updates": sum(len(r.get("rejected", {})) for r in train_rows),
            "failed_rounds": sum(1 for r in train_rows if "round_failed" in r),
            "sim_time_s": train_rows[-1].get("sim_time_s"),
            "sim_dropped_updates": sum(r.get("sim_dropped", 0) for r in train_rows),
        })
    return out
