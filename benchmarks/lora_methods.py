"""Federated LoRA methods side by side (issue 26): FedAvg-LoRA vs FFA-LoRA vs FedSA-LoRA on IID and
Dirichlet(0.5) label-skewed clients, and a federation of clients with ranks 4, 8 and 16 (in thirds) under
HetLoRA and FlexLoRA against everyone at rank 4. MiniLM-L6 on 20 Newsgroups (configs/lora_20news.yaml:
1,200 documents, 8 clients, 4 per round, 8 rounds, personalized evaluation on a held-out fifth of each
client's documents).

    python benchmarks/lora_methods.py --out benchmarks/results/lora_methods.json

Reported per run: the global model's final accuracy on the test subset, the mean personalized accuracy of
the last round's clients on their own held-out documents, bytes up and down per client and round (by rank
for heterogeneous clients) and the LoRA aggregation error (mean over rounds). Finished runs in --runs are
reused when their config is unchanged.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from results_io import parse_seeds, print_table, reuse_or_clear, save  # benchmarks/results_io.py

from fedpeft.config import load_config
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import run

PARTITIONS = {"iid": ["federation.partition.scheme=iid"],
              "dirichlet0.5": ["federation.partition={scheme: dirichlet_label, alpha: 0.5}"]}
METHODS = {"fedavg": ["algorithm.name=fedavg"], "ffa_lora": ["algorithm.name=ffa_lora"],
           "fedsa_lora": ["algorithm.name=fedsa_lora"]}
THIRDS = "algorithm.rank_groups=[{rank: 4, share: 0.34}, {rank: 8, share: 0.33}, {rank: 16, share: 0.33}]"
HETERO = {"rank4_all": ["algorithm.name=fedavg", "peft.r=4", "peft.alpha=8"],
          "hetlora": ["algorithm.name=hetlora", "peft.r=16", "peft.alpha=32", THIRDS],
          "flexlora": ["algorithm.name=flexlora", "peft.r=16", "peft.alpha=32", THIRDS]}


def describe(run_dir: Path, label: dict) -> dict:
    rows = read_metrics(run_dir)
    later = [r for r in rows if r["round"] > 0]
    last_eval = [r for r in later if "eval_accuracy" in r][-1]
    personal = [r for r in later if "personal_accuracy" in r]
    up = [b for r in later for b in r["bytes_up"].values()]
    down = [b for r in later for b in r["bytes_down"].values()]
    out = {**label, "final_accuracy": last_eval["eval_accuracy"], "initial_accuracy": rows[0].get("eval_accuracy"),
           "personal_accuracy": personal[-1]["personal_accuracy"] if personal else None,
           "bytes_up_per_client_round": statistics.mean(up), "bytes_down_per_client_round": statistics.mean(down),
           "run_dir": str(run_dir)}
    errors = [r["agg_lora_aggregation_error"] for r in later if "agg_lora_aggregation_error" in r]
    out["aggregation_error_mean"] = statistics.mean(errors) if errors else None
    ranks = {}
    for r in later:
        for c, rank in r.get("client_rank", {}).items():
            ranks.setdefault(rank, {"up": [], "down": []})
            ranks[rank]["up"].append(r["bytes_up"][c])
            ranks[rank]["down"].append(r["bytes_down"][c])
    if ranks:
        out["bytes_by_rank"] = {str(k): {"up": statistics.mean(v["up"]), "down": statistics.mean(v["down"])}
                                for k, v in sorted(ranks.items())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/lora_20news.yaml")
    ap.add_argument("--runs", default="runs/lora_methods")
    ap.add_argument("--out", default="benchmarks/results/lora_methods.json")
    ap.add_argument("--seeds", default=None, help="e.g. 0,1,2 (default: the config's seed)")
    ap.add_argument("--parts", default="methods,hetero", help="methods and/or hetero")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds) or [None]
    cells = []
    if "methods" in args.parts:
        cells += [(f"{p}/{m}", {"partition": p, "method": m}, [*PARTITIONS[p], *METHODS[m]])
                  for p in PARTITIONS for m in METHODS]
    if "hetero" in args.parts:
        cells += [(f"iid/{m}", {"partition": "iid", "method": m}, [*PARTITIONS["iid"], *HETERO[m]]) for m in HETERO]
    rows = []
    for seed in seeds:
        for name, label, sets in cells:
            seed_sets = [] if seed is None else [f"seed={seed}"]
            cfg = load_config(args.config, [*sets, *seed_sets, "runtime.progress=false", *args.set])
            run_dir = Path(args.runs) / (name if seed is None else f"{name}-seed{seed}")
            if not reuse_or_clear(run_dir, cfg, name):
                run(cfg, run_dir)
            rows.append(describe(run_dir, {**label, "seed": cfg.seed}))
            print({k: v for k, v in rows[-1].items() if k != "run_dir"}, flush=True)
            save(args.out, {"config": args.config, "partitions": PARTITIONS, "methods": METHODS, "hetero": HETERO,
                            "rows": rows})
    print_table(["partition", "method", "seed", "global acc", "personalized acc", "KiB up / client / round",
                 "KiB down / client / round", "aggregation error (mean)"],
                [[r["partition"], r["method"], r["seed"], f"{r['final_accuracy']:.4f}",
                  "-" if r["personal_accuracy"] is None else f"{r['personal_accuracy']:.4f}",
                  f"{r['bytes_up_per_client_round'] / 1024:.1f}", f"{r['bytes_down_per_client_round'] / 1024:.1f}",
                  "-" if r["aggregation_error_mean"] is None else f"{r['aggregation_error_mean']:.4f}"]
                 for r in rows])
    for r in rows:
        if "bytes_by_rank" in r:
            print(r["method"], {k: {d: round(v / 1024, 1) for d, v in x.items()} for k, x in r["bytes_by_rank"].items()})


if __name__ == "__main__":
    main()
