"""Federated LoRA methods side by side (issue 26): FedAvg-LoRA vs FFA-LoRA vs FedSA-LoRA vs FLoRA vs
FedEx-LoRA on IID and Dirichlet(0.5)-skewed clients, and a federation of clients with ranks 4, 8 and 16 (in
thirds) under HetLoRA and FlexLoRA against everyone at rank 4.

* minilm-20news: MiniLM-L6 on 20 Newsgroups (configs/lora_20news.yaml: 1,200 documents, 8 clients, 4 per
  round, 6 rounds of 2 local epochs, Dirichlet skew over the labels); the heterogeneous ranks run here.
* smollm2-e2e: SmolLM2-135M on E2E NLG (configs/e2e_smollm2_lora.yaml at a smaller scale: 480 pairs, 6
  clients, 3 per round, 3 rounds of 5 local steps; Dirichlet skew over the restaurants' eat_type).

Every client keeps a fifth of its examples out of training to score its personalized model on
(eval.personalized).

    python benchmarks/lora_methods.py --out benchmarks/results/lora_methods.json

Reported per run: the global model's final score (accuracy / ROUGE-L) on the test subset, the personalized
score of the last round's clients on their own held-out examples (mean weighted by their sizes; each client is
scored on receipt, before it trains, and the share of them with no earlier accepted update is reported), bytes up
and down per client and round (by rank for heterogeneous clients) and the LoRA aggregation error (mean over
rounds). Finished runs in --runs are reused when their config is unchanged, and so are the rows of an earlier
--out file measured with the same config (its SHA-256 is kept in each row) when --runs has no directory for
them; with --seeds, a table of mean ± sample standard deviation over the seeds, with Welch's t of each method
against FedAvg-LoRA (the heterogeneous ranks: against everyone at rank 4), follows the runs' table.
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
    welch_t,
    with_earlier,
)

from fedpeft.rundir import read_metrics

E2E_SKEW = "federation.partition={scheme: dirichlet_column, column: eat_type, alpha: 0.5}"
SUITES = {
    "minilm-20news": {"config": "configs/lora_20news.yaml", "sets": [],
                      "partitions": {"iid": ["federation.partition.scheme=iid"],
                                     "dirichlet0.5": ["federation.partition={scheme: dirichlet_label, alpha: 0.5}"]}},
    "smollm2-e2e": {"config": "configs/e2e_smollm2_lora.yaml",
                    "sets": ["task.max_train_examples=480", "federation.num_clients=6", "federation.clients_per_round=3",
                             "federation.rounds=3", "train.local_steps=5", "eval.every=3", "eval.max_examples=24",
                             "task.generation_max_new_tokens=32", "eval.personalized=true"],
                    "partitions": {"iid": ["federation.partition.scheme=iid"],
                                   "dirichlet0.5": [E2E_SKEW]}},
}
METHODS = {m: [f"algorithm.name={m}"] for m in ("fedavg", "ffa_lora", "fedsa_lora", "flora", "fedex_lora")}
THIRDS = "algorithm.rank_groups=[{rank: 4, share: 0.34}, {rank: 8, share: 0.33}, {rank: 16, share: 0.33}]"
HETERO = {"rank4_all": ["algorithm.name=fedavg", "peft.r=4", "peft.alpha=8"],
          "hetlora": ["algorithm.name=hetlora", "peft.r=16", "peft.alpha=32", THIRDS],
          "flexlora": ["algorithm.name=flexlora", "peft.r=16", "peft.alpha=32", THIRDS]}


LABEL = ("suite", "partition", "method", "seed")  # what tells the rows of the results file apart


def cell_sets(suite: str, partition: str, method: str) -> list[str] | None:
    """The overrides of one cell (None: no such cell)."""
    spec = SUITES.get(suite)
    if spec is None or partition not in spec["partitions"]:
        return None
    if method in METHODS:
        return [*spec["partitions"][partition], *METHODS[method]]
    if method in HETERO and partition == "iid" and suite == "minilm-20news":
        return [*spec["partitions"]["iid"], *HETERO[method]]
    return None


def cell_config(suite: str, sets: list[str], seed: int | None, extra: list[str]):
    seed_sets = [] if seed is None else [f"seed={seed}"]
    return load_config(SUITES[suite]["config"], [*SUITES[suite]["sets"], *sets, *seed_sets, *extra])


def cell_digest(row: dict, extra: list[str]) -> str | None:
    """The config digest a results row's cell has now (None when the script no longer has the cell)."""
    sets = cell_sets(row.get("suite"), row.get("partition"), row.get("method"))
    return None if sets is None else config_digest(cell_config(row["suite"], sets, row.get("seed"), extra))


def describe(run_dir: Path, label: dict, metric: str) -> dict:
    rows = read_metrics(run_dir)
    later = [r for r in rows if r["round"] > 0]
    last_eval = [r for r in later if f"eval_{metric}" in r][-1]
    personal = [r for r in later if f"personal_{metric}" in r]
    up = [b for r in later for b in r["bytes_up"].values()]
    down = [b for r in later for b in r["bytes_down"].values()]
    out = {**label, "metric": metric, "final": last_eval[f"eval_{metric}"], "initial": rows[0].get(f"eval_{metric}"),
           "personal": personal[-1][f"personal_{metric}"] if personal else None,
           "bytes_up_per_client_round": statistics.mean(up), "bytes_down_per_client_round": statistics.mean(down),
           "run_dir": str(run_dir)}
    out["personal_untrained_share"] = untrained_share(later)
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


def untrained_share(rows: list[dict]) -> float | None:
    """Of the clients scored in the last personalized evaluation, the share that had no accepted update before
    that round. A client is scored on receipt, before it trains, so such a client's personalized model holds
    nothing of its own yet (FedSA-LoRA: the initial B)."""
    trained: set[str] = set()
    share = None
    for r in rows:
        scored = r.get("client_personal", {})
        if scored:
            share = sum(c not in trained for c in scored) / len(scored)
        trained |= {c for c in r["bytes_up"] if c not in r.get("rejected", {})}
    return share


def spread(values: list[float]) -> str:
    """'mean ± sample standard deviation' (the mean alone for one value, '-' for none)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--runs", default="runs/lora_methods")
    ap.add_argument("--out", default="benchmarks/results/lora_methods.json")
    ap.add_argument("--seeds", default=None, help="e.g. 0,1,2 (default: the config's seed)")
    ap.add_argument("--parts", default="methods,hetero", help="methods and/or hetero (hetero: minilm-20news only)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds) or [None]
    cells = []
    for suite in args.suites.split(","):
        spec = SUITES[suite]
        if "methods" in args.parts:
            cells += [(suite, f"{p}/{m}", {"suite": suite, "partition": p, "method": m}, [*sets, *METHODS[m]])
                      for p, sets in spec["partitions"].items() for m in args.methods.split(",")]
        if "hetero" in args.parts and suite == "minilm-20news":
            cells += [(suite, f"iid/{m}", {"suite": suite, "partition": "iid", "method": m},
                       [*spec["partitions"]["iid"], *HETERO[m]]) for m in HETERO]
    earlier = earlier_rows(args.out)
    carried = carried_over(earlier, lambda r: cell_digest(r, args.set))
    rows = []
    for seed in seeds:
        for suite, name, label, sets in cells:
            cfg = cell_config(suite, sets, seed, args.set)
            base_seed = load_config(SUITES[suite]["config"], SUITES[suite]["sets"]).seed
            # the config's own seed keeps the directory without a suffix, so --seeds 0,1,2 reuses the runs of a first
            # invocation without --seeds
            run_dir = Path(args.runs) / suite / (name if seed in (None, base_seed) else f"{name}-seed{seed}")
            digest, label = config_digest(cfg), {**label, "seed": cfg.seed}
            row = None if run_dir.exists() else kept_row(earlier, label, digest, f"{suite}/{name}")
            if row is None:
                train_or_reuse(cfg, run_dir, f"{suite}/{name}")
                row = {**describe(run_dir, label, cfg.task_metric()), "config_digest": digest}
            rows.append(row)
            print({k: v for k, v in rows[-1].items() if k not in ("run_dir", "config_digest")}, flush=True)
            save(args.out, {"suites": SUITES, "methods": METHODS, "hetero": HETERO,
                            "rows": with_earlier(rows, carried, LABEL)})
    rows = with_earlier(rows, carried, LABEL)
    print_table(["suite", "partition", "method", "seed", "metric", "global", "personalized",
                 "scored before their first update", "KiB up / client / round", "KiB down / client / round",
                 "aggregation error (mean)"],
                [[r["suite"], r["partition"], r["method"], r["seed"], r["metric"], f"{r['final']:.4f}",
                  "-" if r["personal"] is None else f"{r['personal']:.4f}",
                  "-" if r.get("personal_untrained_share") is None else f"{r['personal_untrained_share']:.2f}",
                  f"{r['bytes_up_per_client_round'] / 1024:.1f}", f"{r['bytes_down_per_client_round'] / 1024:.1f}",
                  "-" if r["aggregation_error_mean"] is None else f"{r['aggregation_error_mean']:.4f}"]
                 for r in rows])
    if len(seeds) > 1:
        print(f"\nmean and sample standard deviation over seeds {args.seeds}")
        cells_seen = list(dict.fromkeys((r["suite"], r["partition"], r["method"]) for r in rows))
        table = []
        for key in cells_seen:
            mine = [r for r in rows if (r["suite"], r["partition"], r["method"]) == key]
            errors = [r["aggregation_error_mean"] for r in mine if r["aggregation_error_mean"] is not None]
            base_method = "rank4_all" if key[2] in HETERO else "fedavg"
            base = [r for r in rows if (r["suite"], r["partition"], r["method"]) == (key[0], key[1], base_method)]
            table.append([*key, len(mine), spread([r["final"] for r in mine]),
                          spread([r["personal"] for r in mine if r["personal"] is not None]),
                          f"{base_method}: " + " / ".join(welch_t([r[k] for r in mine], [r[k] for r in base])
                                                          for k in ("final", "personal")),
                          f"{statistics.mean(r['bytes_up_per_client_round'] for r in mine) / 1024:.1f}",
                          f"{statistics.mean(r['bytes_down_per_client_round'] for r in mine) / 1024:.1f}",
                          spread(errors)])
        print_table(["suite", "partition", "method", "seeds", "global", "personalized",
                     "Welch's t against (global / personalized)", "KiB up / client / round",
                     "KiB down / client / round", "aggregation error (mean over rounds)"], table)
    for r in rows:
        if "bytes_by_rank" in r:
            print(r["method"], {k: {d: round(v / 1024, 1) for d, v in x.items()} for k, x in r["bytes_by_rank"].items()})


if __name__ == "__main__":
    main()
