"""Byzantine-robust aggregation under simulated attacks (issue 27): every rule of algorithm.robust against every
attack of federation.attackers, at 0%, 10% and 30% attackers, beside plain FedAvg.

MiniLM-L6 with LoRA on SST-2 (configs/robust_sst2.yaml: 2,000 training sentences, 20 IID clients, 10 per round,
10 rounds of one local epoch, accuracy on 500 validation sentences every 2 rounds). The defences are set for
30% attackers, 3 of a round's 10 updates on average: trimmed mean trims 3 at each end (trim_fraction 0.3), Krum
and Multi-Krum assume f = 3 (and need 9 of the 10 updates), norm bounding clips to the median norm of the
round. With 6 attackers among 20 clients and 10 drawn per round, a round holds 4 or more attackers with
probability 0.31 (hypergeometric), beyond what trimming 3 or f = 3 covers. The attacks are fedpeft's defaults:
sign_flip (the update reversed), scale (x10), noise (Gaussian, std 0.1 per entry in place of the update), label_flip (trained on flipped labels).

    python benchmarks/robust_aggregation.py --out benchmarks/results/robust_aggregation.json

Reported per run: final and best accuracy, rounds to --target (the first evaluated round at or above it), and
for Krum / Multi-Krum the share of the attackers' updates they excluded. Finished runs in --runs are reused
when their config is unchanged, and so are the rows of an earlier --out file measured with the same config (its
SHA-256 is kept in each row) when --runs has no directory for them; the rows of cells an invocation does not run
(other seeds, rules, attacks or fractions) stay in the file, so e.g. `--seeds 1,2 --attacks scale --fractions 0.3`
adds seeds to those cells. The headline tables give each rule's final
accuracy under each condition (mean ± sample standard deviation over --seeds) and as a share of clean FedAvg's
at the same seed; both are saved under "headline", with rounds-to-target and Krum's exclusion share per seed.
Accuracy is evaluated every 2 rounds, so rounds-to-target is even.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from results_io import (  # benchmarks/results_io.py
    carried_over,
    config_digest,
    earlier_rows,
    kept_row,
    load_config,
    parse_seeds,
    print_table,
    save,
    train_or_reuse,
    with_earlier,
)

from fedpeft.rundir import read_metrics

CONFIG = "configs/robust_sst2.yaml"
RULES = {
    "fedavg": [],
    "median": ["algorithm.robust={rule: median}", "federation.min_replies=3"],
    "trimmed_mean": ["algorithm.robust={rule: trimmed_mean, trim_fraction: 0.3}", "federation.min_replies=4"],
    "krum": ["algorithm.robust={rule: krum, num_attackers: 3}", "federation.min_replies=9"],
    "multi_krum": ["algorithm.robust={rule: multi_krum, num_attackers: 3}", "federation.min_replies=9"],
    "norm_bound": ["algorithm.robust={rule: norm_bound}"],
}
ATTACKS = ("sign_flip", "scale", "noise", "label_flip")
FRACTIONS = (0.1, 0.3)
LABEL = ("condition", "rule", "seed")  # what tells the rows of the results file apart


def conditions(attacks: list[str], fractions: list[float]) -> dict[str, list[str]]:
    out = {"clean": []}
    for fraction in fractions:
        for attack in attacks:
            out[f"{attack} {int(fraction * 100)}%"] = [f"federation.attackers={{fraction: {fraction}, attack: {attack}}}"]
    return out


def cell_config(rule: str, attack_sets: list[str], seed: int | None, extra: list[str]):
    seed_sets = [] if seed is None else [f"seed={seed}"]
    return load_config(CONFIG, [*RULES[rule], *attack_sets, *seed_sets, *extra])


def cell_digest(row: dict, every_condition: dict[str, list[str]], extra: list[str]) -> str | None:
    """The config digest a results row's cell has now (None when the script no longer has the cell)."""
    if row.get("rule") not in RULES or row.get("condition") not in every_condition:
        return None
    return config_digest(cell_config(row["rule"], every_condition[row["condition"]], row.get("seed"), extra))


def describe(run_dir: Path, label: dict, target: float) -> dict:
    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval_accuracy" in r]
    later = [r for r in rows if r["round"] > 0]
    reached = [r["round"] for r in evals if r["eval_accuracy"] >= target]
    out = {**label, "final": evals[-1]["eval_accuracy"], "best": max(r["eval_accuracy"] for r in evals),
           "initial": evals[0]["eval_accuracy"], "rounds_to_target": reached[0] if reached else None,
           "curve": {r["round"]: r["eval_accuracy"] for r in evals}, "run_dir": str(run_dir)}
    sent = [(r["round"], c) for r in later for c in r.get("adversarial_clients", [])
            if str(c) not in r.get("rejected", {})]  # the attackers' updates that reached the rule
    out["attacker_updates"] = len(sent)
    if any("robust_excluded" in r for r in later) and sent:
        excluded = {(r["round"], c) for r in later for c in r.get("robust_excluded", [])}
        out["attackers_excluded"] = sum(s in excluded for s in sent) / len(sent)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="runs/robust_aggregation")
    ap.add_argument("--out", default="benchmarks/results/robust_aggregation.json")
    ap.add_argument("--seeds", default=None, help="e.g. 0,1,2 (default: the config's seed)")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    ap.add_argument("--target", type=float, default=0.8, help="accuracy for rounds-to-target")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds) or [None]
    conds = conditions(args.attacks.split(","), [float(f) for f in args.fractions.split(",")])
    every_condition = conditions(list(ATTACKS), list(FRACTIONS))
    earlier = earlier_rows(args.out)
    carried = carried_over(earlier, lambda r: cell_digest(r, every_condition, args.set))
    rows = []
    for seed in seeds:
        for cond, attack_sets in conds.items():
            for rule in args.rules.split(","):
                cfg = cell_config(rule, attack_sets, seed, args.set)
                name = f"{cond.replace(' ', '-').replace('%', 'pct')}/{rule}" + ("" if seed is None else f"-seed{seed}")
                run_dir = Path(args.runs) / name
                digest, label = config_digest(cfg), {"condition": cond, "rule": rule, "seed": cfg.seed}
                row = None if run_dir.exists() else kept_row(earlier, label, digest, name)
                if row is None:
                    train_or_reuse(cfg, run_dir, name)
                    row = {**describe(run_dir, label, args.target), "config_digest": digest}
                rows.append(row)
                print({k: v for k, v in rows[-1].items() if k not in ("run_dir", "curve", "config_digest")}, flush=True)
                save(args.out, {"config": CONFIG, "rules": RULES, "conditions": every_condition, "target": args.target,
                                "rows": with_earlier(rows, carried, LABEL)})
    rows = with_earlier(rows, carried, LABEL)
    conds = list(dict.fromkeys([*(c for c in every_condition if any(r["condition"] == c for r in rows)),
                                *(r["condition"] for r in rows)]))
    print_table(["condition", "rule", "seed", "final", "best", f"rounds to {args.target:g}", "attackers excluded"],
                [[r["condition"], r["rule"], r["seed"], f"{r['final']:.3f}", f"{r['best']:.3f}",
                  "-" if r["rounds_to_target"] is None else r["rounds_to_target"],
                  f"{r['attackers_excluded']:.2f}" if "attackers_excluded" in r else "-"] for r in rows])
    summary = headline(rows, conds)
    save(args.out, {"config": CONFIG, "rules": RULES, "conditions": every_condition, "target": args.target,
                    "rows": rows, "headline": summary})
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    def table(title: str, cell_text, key: str, columns: list[str], skip: tuple[str, ...] = ()) -> None:
        print(f"\n{title}")
        print_table(["condition", *columns], [[cond, *(cell_text(summary[cond].get(rule), key) for rule in columns)]
                                              for cond in conds if cond in summary and cond not in skip])

    table("final accuracy (mean ± sample std where a cell has several seeds)", spread, "final", rules)
    table("final accuracy as a share of clean FedAvg's at the same seed", spread, "share", rules)
    table(f"rounds to {args.target:g} (per seed in seed order, '-' where never reached; evaluated every 2 rounds)",
          per_seed, "rounds_to_target", rules)
    table("share of the attackers' updates that Krum / Multi-Krum excluded (per seed in seed order)",
          per_seed, "attackers_excluded", ["krum", "multi_krum"], skip=("clean",))


def headline(rows: list[dict], conds: list[str]) -> dict:
    """Per condition and rule: the final accuracies over seeds, and each as a share of clean FedAvg's final
    accuracy at the same seed (mean, sample standard deviation and per-seed values)."""
    clean = {r["seed"]: r["final"] for r in rows if r["condition"] == "clean" and r["rule"] == "fedavg"}
    out: dict = {}
    for cond in conds:
        for rule in dict.fromkeys(r["rule"] for r in rows):
            mine = sorted((r for r in rows if r["condition"] == cond and r["rule"] == rule), key=lambda r: r["seed"])
            if not mine:
                continue
            cell = {"seeds": [r["seed"] for r in mine], "final": [r["final"] for r in mine],
                    "share": [r["final"] / clean[r["seed"]] for r in mine if r["seed"] in clean],
                    "rounds_to_target": [r["rounds_to_target"] for r in mine]}
            excluded = [r["attackers_excluded"] for r in mine if "attackers_excluded" in r]
            if excluded:
                cell["attackers_excluded"] = excluded
            for key in ("final", "share"):
                values = cell[key]
                cell[f"{key}_mean"] = statistics.mean(values) if values else None
                cell[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
            out.setdefault(cond, {})[rule] = cell
    return out


def spread(cell: dict | None, key: str) -> str:
    """'mean ± std' of a headline cell's values (the value alone for one seed, '-' for none)."""
    if cell is None or cell.get(f"{key}_mean") is None:
        return "-"
    std = cell[f"{key}_std"]
    return f"{cell[f'{key}_mean']:.3f}" + ("" if std is None else f" ± {std:.3f}")


def per_seed(cell: dict | None, key: str) -> str:
    """A headline cell's per-seed values of key, comma-separated ('-' for a missing value or cell)."""
    if cell is None or key not in cell:
        return "-"
    return ", ".join("-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v)) for v in cell[key])


if __name__ == "__main__":
    main()
