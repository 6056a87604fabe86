"""Starting learning rates: a short sweep of the clients' learning rate for every PEFT method (under FedAvg) and every
algorithm (with LoRA, or the PEFT method it needs), on one bundled task (issue 40).

* PEFT methods and algorithms: MiniLM-L6 on SST-2 (configs/lr_sweep_sst2.yaml: 1,000 training sentences over 10
  IID clients, 5 per round, 6 rounds of one local epoch of batch 16, AdamW), scored on all 872 validation
  sentences (majority class 0.509). FedSA-LoRA is scored by its personalized accuracy (each client's own model on
  a fifth of its sentences held out), its global model not being the method's. FedPepTAO trains deep prompts
  (prefix tuning, its paper's method); HetLoRA and FlexLoRA run clients of ranks 4 and 8 (half each).
* FedSP needs a causal LM and its distilled auxiliary model: configs/fedsp_arc_easy.yaml made smaller (3 rounds
  of 5 clients, 50 distillation steps, 100 evaluation questions).

One seed: with 872 sentences one accuracy has a standard error of about 1.7 points, so neighbouring rates within
about 3 points of each other are a tie (FedSA-LoRA's personalized score is over the last round's 5 clients' ~100
held-out sentences: about 5 points); the grid steps by about 3x. The documented starting rate is the best
final score of the grid.

    python benchmarks/lr_sweep.py --only lora,houlsby --out benchmarks/results/lr_sweep.json   # some rows only
    python benchmarks/lr_sweep.py --only fedsp --out benchmarks/results/lr_sweep_fedsp.json   # FedSP apart: long runs
    python benchmarks/lr_sweep.py --only fedsp --rates 1e-2,3e-2,1e-1 --seeds 1,2 \
        --out benchmarks/results/lr_sweep_fedsp.json       # more seeds where one seed cannot tell two rates apart
    python benchmarks/lr_sweep.py --table --out benchmarks/results/lr_sweep.json               # the table, no runs

(without --only every row runs, FedSP included; the other rows of --out are kept while their config is unchanged.)

Finished runs in --runs are reused when their config is unchanged, and so are the rows of an earlier --out file
measured with the same config (its SHA-256 is kept in each row); the rows of cells (row, rate, seed) not run this
time stay while their cell's config is unchanged. --rates and --seeds need --only. Where a rate has several seeds,
the table gives the mean score ± its sample standard deviation, the best rate is the best mean, and Welch's t of
the best rate against the next best is printed below the table where both have several seeds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from results_io import (  # benchmarks/
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

from fedpeft.metrics.accounting import metric_key
from fedpeft.rundir import read_metrics

ADAPTERS = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
SCALES = [3e-3, 1e-2, 3e-2, 1e-1]  # IA3's scaling vectors and BitFit's biases
PROMPTS = [3e-3, 1e-2, 3e-2, 1e-1]
ALGORITHMS = [3e-3, 1e-2]  # LoRA's best under FedAvg (1e-2) and the rate below; 3e-2 collapses LoRA under FedAvg
SST2 = "configs/lr_sweep_sst2.yaml"
FEDSP = ("configs/fedsp_arc_easy.yaml", ["federation.num_clients=5", "federation.clients_per_round=5",
                                         "federation.rounds=3", "algorithm.distill_steps=50", "eval.every=3",
                                         "eval.max_examples=100"])
CELL = ("row", "lr", "seed")  # what tells the rows of the results file apart
HALVES = "algorithm.rank_groups=[{rank: 4, share: 0.5}, {rank: 8, share: 0.5}]"

# row name -> (kind, config, overrides, grid)
ROWS: dict[str, tuple[str, str, list[str], list[float]]] = {
    "full": ("peft", SST2, ["peft={method: full}"], [3e-5, 1e-4, 3e-4, 1e-3]),
    "lora": ("peft", SST2, [], ADAPTERS),
    "houlsby": ("peft", SST2, ["peft={method: houlsby}"], ADAPTERS),
    "pfeiffer": ("peft", SST2, ["peft={method: pfeiffer}"], ADAPTERS),
    "ia3": ("peft", SST2, ["peft={method: ia3}"], SCALES),
    "bitfit": ("peft", SST2, ["peft={method: bitfit}"], [1e-3, *SCALES]),
    "prompt_tuning": ("peft", SST2, ["peft={method: prompt_tuning}"], PROMPTS),
    "p_tuning": ("peft", SST2, ["peft={method: p_tuning}"], PROMPTS),
    "prefix_tuning": ("peft", SST2, ["peft={method: prefix_tuning}"], PROMPTS),
    "fedprox": ("algorithm", SST2, ["algorithm.name=fedprox"], ALGORITHMS),
    "fedavgm": ("algorithm", SST2, ["algorithm.name=fedavgm"], ALGORITHMS),
    "fedadam": ("algorithm", SST2, ["algorithm.name=fedadam"], ALGORITHMS),
    "fedyogi": ("algorithm", SST2, ["algorithm.name=fedyogi"], ALGORITHMS),
    "ffa_lora": ("algorithm", SST2, ["algorithm.name=ffa_lora"], [*ALGORITHMS, 3e-2]),  # only B trains: higher?
    "fedsa_lora": ("algorithm", SST2, ["algorithm.name=fedsa_lora", "eval.personalized=true"], ALGORITHMS),
    "flora": ("algorithm", SST2, ["algorithm.name=flora"], ALGORITHMS),
    "fedex_lora": ("algorithm", SST2, ["algorithm.name=fedex_lora"], ALGORITHMS),
    "hetlora": ("algorithm", SST2, ["algorithm.name=hetlora", HALVES], ALGORITHMS),
    "flexlora": ("algorithm", SST2, ["algorithm.name=flexlora", HALVES], ALGORITHMS),
    "headprune": ("algorithm", SST2, ["algorithm.name=headprune"], ALGORITHMS),
    "fedpeptao": ("algorithm", SST2, ["peft={method: prefix_tuning}", "algorithm.name=fedpeptao"],
                  [3e-3, 1e-2, 3e-2]),
    "fedsp": ("algorithm", FEDSP[0], FEDSP[1], [3e-3, 1e-2, 3e-2, 1e-1]),
}


def cell_config(row: str, lr: float, extra: list[str]):
    _, path, sets, _ = ROWS[row]
    return load_config(path, [*sets, f"train.lr={lr:g}", *extra])


def measure(run_dir: Path, label: dict, cfg) -> dict:
    rows = read_metrics(run_dir)
    key = metric_key(cfg.primary_metric())
    scored = [r for r in rows if key in r]
    if not scored:
        raise SystemExit(f"{run_dir}: no {key} in metrics.jsonl (the run scored nothing)")
    return {**label, "score": scored[-1][key], "scored_by": key,
            "curve": {r["round"]: r[key] for r in scored},
            "train_loss_last": next((r["train_loss"] for r in reversed(rows) if "train_loss" in r), None),
            "run_dir": str(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="comma-separated row names (default: every row)")
    ap.add_argument("--rates", help="comma-separated rates, with --only (default: each row's grid)")
    ap.add_argument("--seeds", help="comma-separated seeds, with --only (default: the config's own seed)")
    ap.add_argument("--runs", default="runs/lr_sweep")
    ap.add_argument("--out", default="benchmarks/results/lr_sweep.json")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--table", action="store_true", help="print the table of --out and stop (no runs)")
    args = ap.parse_args()
    if args.table:
        table(earlier_rows(args.out))
        return
    if (args.rates is not None or args.seeds is not None) and not args.only:
        raise SystemExit("--rates and --seeds apply to the rows named by --only (the rows' grids differ): "
                         "add e.g. --only fedsp")
    only = args.only.split(",") if args.only else list(ROWS)
    unknown = sorted(set(only) - set(ROWS))
    if unknown or len(set(only)) != len(only):
        raise SystemExit(f"--only {args.only!r}: give distinct row names; known: {', '.join(ROWS)}")
    rates = parse_rates(args.rates)
    seeds = parse_seeds(args.seeds)
    earlier = carried(earlier_rows(args.out), args.set)
    results: list[dict] = []
    for name in only:
        for lr in ROWS[name][3] if rates is None else rates:
            for seed in [None] if seeds is None else seeds:
                results.append(cell(name, lr, seed, args, earlier))
                save(args.out, {"rows": with_earlier(results, earlier, CELL)})
    results = with_earlier(results, earlier, CELL)  # rows of cells not run this time stay
    save(args.out, {"rows": results})
    table(results)


def seeded_config(row: str, lr: float, seed: int | None, extra: list[str]):
    """The config of one cell and whether its seed is the config's own (seed None: the config's own)."""
    cfg = cell_config(row, lr, extra)
    if seed is None or seed == cfg.seed:
        return cfg, True
    return cell_config(row, lr, [*extra, f"seed={seed}"]), False


def carried(earlier: list[dict], extra: list[str]) -> list[dict]:
    """The earlier rows whose cell still has the config they were measured with (the others are dropped with a
    message), each with its seed (rows written before --seeds existed have no seed field: the config's own)."""
    def digest_of(r: dict) -> str | None:
        if r.get("row") not in ROWS:
            return None
        return config_digest(seeded_config(r["row"], r["lr"], r.get("seed"), extra)[0])

    return [r if r.get("seed") is not None else {**r, "seed": cell_config(r["row"], r["lr"], extra).seed}
            for r in carried_over(earlier, digest_of)]


def cell(name: str, lr: float, seed: int | None, args, earlier: list[dict]) -> dict:
    """The row of one (row, rate, seed): kept from ``earlier`` when measured with the same config, else read
    from a finished run in --runs or trained."""
    cfg, own_seed = seeded_config(name, lr, seed, args.set)
    label, where = {"row": name, "lr": lr, "seed": cfg.seed}, f"{name} {lr:g} seed {cfg.seed}"
    digest = config_digest(cfg)  # the seed is part of it
    kept = kept_row(earlier, label, digest, where)
    if kept is not None:
        return kept
    run_dir = Path(args.runs) / name / (f"lr{lr:g}" if own_seed else f"lr{lr:g}_seed{cfg.seed}")
    start = time.perf_counter()
    train_or_reuse(cfg, run_dir, where, note="")
    row = {**measure(run_dir, label, cfg), "config_digest": digest, "wall_s": round(time.perf_counter() - start, 1)}
    print(f"[{where}] {row['scored_by']} {row['score']:.3f}", flush=True)
    return row


def parse_rates(text: str | None) -> list[float] | None:
    """``--rates 1e-2,3e-2`` -> [0.01, 0.03]; None (the option not given): each row's grid."""
    if text is None:
        return None
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or len({f"{r:g}" for r in rates}) != len(rates) or not all(math.isfinite(r) and r > 0 for r in rates):
        raise SystemExit(f"--rates {text!r}: give distinct finite positive numbers, comma-separated, e.g. --rates 1e-2,3e-2")
    return rates


def table(results: list[dict]) -> None:
    """One line per row: the best rate by the mean score over its seeds, then each rate's mean (± the sample
    standard deviation and the number of seeds where there are several); below the table, Welch's t of the best
    rate against the next best where both have several seeds."""
    by_cell: dict[str, dict[float, list[float]]] = {}
    for r in results:
        by_cell.setdefault(r["row"], {}).setdefault(r["lr"], []).append(r["score"])
    scored_by = {r["row"]: r["scored_by"] for r in results}
    rates = sorted({r["lr"] for r in results})
    rows, tests = [], []
    for name in (n for n in ROWS if n in by_cell):
        cells = by_cell[name]
        ranked = sorted(sorted(cells), key=lambda lr: statistics.mean(cells[lr]), reverse=True)  # ties: lower rate
        best = ranked[0]
        rows.append([ROWS[name][0], name, f"{best:g}", mean_spread(cells[best]), scored_by[name]]
                    + [(f"**{mean_spread(cells[lr])}**" if lr == best else mean_spread(cells[lr]))
                       if lr in cells else "" for lr in rates])
        if len(ranked) > 1 and min(len(cells[best]), len(cells[ranked[1]])) > 1:
            tests.append(f"{name}: {best:g} against {ranked[1]:g}, the next best: Welch's t "
                         f"{welch_t(cells[best], cells[ranked[1]])}")
    print_table(["kind", "name", "starting lr", "score", "scored by", *[f"{lr:g}" for lr in rates]], rows)
    for line in tests:
        print(line)


def mean_spread(scores: list[float]) -> str:
    if len(scores) == 1:
        return f"{scores[0]:.3f}"
    return f"{statistics.mean(scores):.3f} ± {statistics.stdev(scores):.3f} ({len(scores)} seeds)"


if __name__ == "__main__":
    main()
