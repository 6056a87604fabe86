"""What the robust-aggregation runs did inside their rounds, read from their metrics.jsonl (no training): the
figures BENCHMARKS.md "Byzantine-robust aggregation" quotes beside its tables.

    python benchmarks/robust_diagnostics.py --results benchmarks/results/robust_aggregation.json

Per seed: the rounds holding more attackers than the defences assume (f = 3); how many attacker updates Krum
picked and how many Multi-Krum let through beyond the k - 3 that keeping 7 of 10 forces; median update norms
and Krum scores of honest and attacking clients; the norm bound of the rounds with the most attackers; the
aggregate's norm under noise and without attack; the server's aggregation time.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from results_io import earlier_rows  # benchmarks/results_io.py

from fedpeft.rundir import read_metrics

ASSUMED_ATTACKERS = 3  # f of the script's Krum / Multi-Krum cells, and what trimming 3 at each end covers


def rounds(row: dict) -> list[dict]:
    return [r for r in read_metrics(Path(row["run_dir"])) if r["round"] > 0]


def split(rs: list[dict], attackers: list[set[str]], key: str) -> tuple[list[float], list[float]]:
    """Every round's per-client values of key, the honest clients' and the attackers'."""
    pairs = [(c in a, v) for r, a in zip(rs, attackers, strict=True) for c, v in r.get(key, {}).items()]
    return [v for bad, v in pairs if not bad], [v for bad, v in pairs if bad]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="benchmarks/results/robust_aggregation.json")
    args = ap.parse_args()
    rows = sorted(earlier_rows(args.results), key=lambda r: (r["condition"], r["rule"], r["seed"]))
    for row in rows:
        if not Path(row["run_dir"]).exists():
            print(f"{row['condition']} / {row['rule']} / seed {row['seed']}: {row['run_dir']} is gone; skipped")
            continue
        rs = rounds(row)
        label = f"{row['condition']} / {row['rule']} / seed {row['seed']}"
        attackers = [{str(c) for c in r.get("adversarial_clients", [])} for r in rs]
        out = [(f"aggregation {sum(r['time_aggregation_s'] for r in rs):.2f} s in {len(rs)} rounds "
                f"(max {max(r['time_aggregation_s'] for r in rs):.3f} s)"),
               f"aggregate norm {min(r['agg_update_norm'] for r in rs):.1f}-{max(r['agg_update_norm'] for r in rs):.1f}"]
        if any(attackers):
            over = sum(len(a) > ASSUMED_ATTACKERS for a in attackers)
            out.append(f"rounds with more than {ASSUMED_ATTACKERS} attackers {over}/{len(rs)}")
            honest, bad = split(rs, attackers, "client_update_norm")
            if honest and bad:  # the norms are reported under a robust rule
                out.append(f"median update norm honest {statistics.median(honest):.2f} "
                           f"attacker {statistics.median(bad):.2f}")
        if any("robust_krum_score" in r for r in rs):
            kept = sum(len(a & {str(c) for c in r["robust_kept"]}) for r, a in zip(rs, attackers, strict=True))
            forced = sum(max(0, len(a) - ASSUMED_ATTACKERS) for a in attackers) if row["rule"] == "multi_krum" else 0
            honest, bad = split(rs, attackers, "robust_krum_score")
            out.append(f"Krum score median honest {statistics.median(honest):.1f}"
                       + (f" attacker {statistics.median(bad):.1f}" if bad else ""))
            if any(attackers):
                out.append(f"attacker updates kept {kept} of {sum(map(len, attackers))} ({forced} forced)")
        if any("robust_bound" in r for r in rs) and any(attackers):
            most = max(len(a) for a in attackers)
            bounds = [r["robust_bound"] for r, a in zip(rs, attackers, strict=True) if len(a) == most]
            out.append(f"norm bound in the rounds with {most} attackers {min(bounds):.1f}-{max(bounds):.1f}")
        print(f"{label}: " + "; ".join(out))


if __name__ == "__main__":
    main()
