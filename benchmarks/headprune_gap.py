"""Head pruning's gap on a multi-class task (issue 40): paper 000's method at 90% sparsity against dense LoRA
(B1), random pruning (B2), the method with random selection and the method at 50% sparsity, on four 20 Newsgroups
groups with the quickstart's federation (configs/headprune_news4.yaml), over 15 rounds, at several seeds.

    python benchmarks/headprune_gap.py prepare           # writes runs/headprune_gap/news4/{train,test}.jsonl
    python benchmarks/headprune_gap.py run --seeds 0,1,2 --out benchmarks/results/headprune_gap.json
    python benchmarks/headprune_gap.py run --table       # the table of --out, no runs

Reported per variant (mean ± sample standard deviation over the seeds, Welch's t against dense LoRA): accuracy
and eval loss after 5 rounds (the quickstart's budget), 10 and 15 rounds, the mean of the last three evaluations,
the largest drop of accuracy between consecutive evaluations (how much it swings) and the upload per client and
round. Each evaluation scores the same seeded 300 of the 1,558 test documents (the largest class is 0.256 of
all 1,558).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from results_io import (  # benchmarks/results_io.py
    config_digest,
    earlier_rows,
    kept_row,
    load_config,
    over_seeds,
    parse_seeds,
    pm,
    print_table,
    save,
    train_or_reuse,
    welch_t,
)

from fedpeft.rundir import read_metrics

CONFIG = "configs/headprune_news4.yaml"
GROUPS = ("comp.graphics", "rec.sport.hockey", "sci.space", "talk.politics.mideast")
VARIANTS = {
    "dense (B1)": ["algorithm.pruning=none", "algorithm.aggregation=fedavg", "algorithm.selection=random"],
    "random pruning (B2)": ["algorithm.pruning=random", "algorithm.aggregation=fedavg", "algorithm.selection=random"],
    "method (random selection)": ["algorithm.selection=random"],
    "method": [],
    "method (50% sparsity)": ["algorithm.sparsity=0.5"],
}
CHECKPOINTS = (5, 10, 15)


def prepare(data: Path, source: Path) -> None:
    """The four groups' documents of 20 Newsgroups' train and test splits, relabelled 0-3 in GROUPS' order."""
    data.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (source / f"{split}.jsonl").read_text().splitlines() if line]
        kept = [{"text": r["text"], "label": GROUPS.index(r["label_text"]), "label_text": r["label_text"]}
                for r in rows if r["label_text"] in GROUPS]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        counts = {g: sum(r["label_text"] == g for r in kept) for g in GROUPS}
        print(f"{data / split}.jsonl: {len(kept)} documents {counts}")


def measure(run_dir: Path, label: dict) -> dict:
    rows = read_metrics(run_dir)
    evals = {r["round"]: r for r in rows if "eval_accuracy" in r}
    acc = [evals[k]["eval_accuracy"] for k in sorted(evals) if k > 0]
    out = {**label, "initial": evals[0]["eval_accuracy"], "last3": statistics.mean(acc[-3:]),
           "largest_drop": max([0.0, *(a - b for a, b in itertools.pairwise(acc))]),
           "up_kib": statistics.mean(b for r in rows if r["round"] > 0 for b in r["bytes_up"].values()) / 1024,
           "run_dir": str(run_dir)}
    for k in CHECKPOINTS:
        out[f"acc{k}"] = evals[k]["eval_accuracy"] if k in evals else None
        out[f"loss{k}"] = evals[k]["eval_loss"] if k in evals else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["prepare", "run"])
    ap.add_argument("--data", default="runs/headprune_gap/news4")
    ap.add_argument("--source", default=None, help="20 Newsgroups jsonl folder (default: ../shared/data/20newsgroups)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--runs", default="runs/headprune_gap")
    ap.add_argument("--out", default="benchmarks/results/headprune_gap.json")
    ap.add_argument("--table", action="store_true", help="print the table of --out and stop (no runs)")
    args = ap.parse_args()
    if args.table:
        rows = earlier_rows(args.out)
        table(rows, sorted({r["seed"] for r in rows}))
        return
    if args.what == "prepare":
        from fedpeft.data.sources import locate_local

        source = Path(args.source) if args.source else locate_local("20newsgroups")
        if source is None:
            raise SystemExit("20newsgroups not found (../shared/data or $FEDPEFT_DATA_DIR); pass --source DIR")
        prepare(Path(args.data), source)
        return
    seeds = parse_seeds(args.seeds)
    earlier = earlier_rows(args.out)
    rows = []
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)} (comma-separated)")
    for variant in variants:
        for seed in seeds:
            cfg = load_config(CONFIG, [*VARIANTS[variant], f"task.dataset={args.data}", f"seed={seed}"])
            label, digest = {"variant": variant, "seed": seed}, config_digest(cfg)
            run_dir = Path(args.runs) / variant.replace(" ", "_").replace("%", "") / f"seed{seed}"
            row = None if run_dir.exists() else kept_row(earlier, label, digest, f"{variant} {seed}")
            if row is None:
                train_or_reuse(cfg, run_dir, f"{variant} {seed}")
                row = {**measure(run_dir, label), "config_digest": digest}
            print({k: v for k, v in row.items() if k not in ("run_dir", "config_digest")}, flush=True)
            rows.append(row)
            save(args.out, {"config": CONFIG, "groups": GROUPS, "variants": VARIANTS, "rows": rows})
    table(rows, seeds)


def table(rows: list[dict], seeds: list[int]) -> None:
    by = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)
    dense = by.get("dense (B1)", [])
    out = []
    for variant, runs in by.items():
        row = over_seeds(runs, [r["seed"] for r in runs])
        t = welch_t([r["acc15"] for r in runs], [r["acc15"] for r in dense]) if variant != "dense (B1)" else "-"
        out.append([variant, *(pm(row, f"acc{k}") for k in CHECKPOINTS), pm(row, "last3"), t,
                    *(pm(row, f"loss{k}") for k in (5, 15)), pm(row, "largest_drop"), pm(row, "up_kib", ".1f")])
    print_table(["variant", *(f"acc round {k}" for k in CHECKPOINTS), "mean of last 3", "t (round 15) vs dense",
                 "eval loss round 5", "eval loss round 15", "largest drop", "KiB up / client / round"], out)


if __name__ == "__main__":
    main()
