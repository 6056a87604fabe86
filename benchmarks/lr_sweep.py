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
    python benchmarks/lr_sweep.py --table --out benchmarks/results/lr_sweep.json               # the table, no runs

(without --only every row runs, FedSP included; the other rows of --out are kept.)

Finished runs in --runs are reused when their config is unchanged, and so are the rows of an earlier --out file
measured with the same config (its SHA-256 is kept in each row).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_io import (  # benchmarks/
    config_digest,
    earlier_rows,
    kept_row,
    print_table,
    reuse_or_clear,
    save,
)

from fedpeft.config import load_config
from fedpeft.metrics.accounting import metric_key
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import run

ADAPTERS = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
SCALES = [3e-3, 1e-2, 3e-2, 1e-1]  # IA3's scaling vectors and BitFit's biases
PROMPTS = [3e-3, 1e-2, 3e-2, 1e-1]
ALGORITHMS = [3e-3, 1e-2]  # LoRA's best under FedAvg (1e-2) and the rate below; 3e-2 collapses LoRA under FedAvg
SST2 = "configs/lr_sweep_sst2.yaml"
FEDSP = ("configs/fedsp_arc_easy.yaml", ["federation.num_clients=5", "federation.clients_per_round=5",
                                         "federation.rounds=3", "algorithm.distill_steps=50", "eval.every=3",
                                         "eval.max_examples=100"])
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
    "fedsp": ("algorithm", FEDSP[0], FEDSP[1], [3e-3, 1e-2, 3e-2]),
}
LABEL = ("row", "lr")


def cell_config(row: str, lr: float, extra: list[str]):
    _, path, sets, _ = ROWS[row]
    return load_config(path, [*sets, f"train.lr={lr:g}", "runtime.progress=false", *extra])


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
    ap.add_argument("--only", default=",".join(ROWS), help="comma-separated row names")
    ap.add_argument("--runs", default="runs/lr_sweep")
    ap.add_argument("--out", default="benchmarks/results/lr_sweep.json")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--table", action="store_true", help="print the table of --out and stop (no runs)")
    args = ap.parse_args()
    if args.table:
        table(earlier_rows(args.out))
        return
    unknown = sorted(set(args.only.split(",")) - set(ROWS))
    if unknown:
        raise SystemExit(f"--only: unknown rows {unknown}; known: {', '.join(ROWS)}")
    earlier = earlier_rows(args.out)
    results = [r for r in earlier if r.get("row") not in args.only.split(",")]
    for name in args.only.split(","):
        for lr in ROWS[name][3]:
            label = {"row": name, "lr": lr}
            cfg = cell_config(name, lr, args.set)
            digest = config_digest(cfg)
            kept = kept_row(earlier, label, digest, f"{name} {lr:g}")
            if kept is not None:
                results.append(kept)
                continue
            run_dir = Path(args.runs) / name / f"lr{lr:g}"
            start = time.perf_counter()
            if not reuse_or_clear(run_dir, cfg, f"{name} {lr:g}"):
                print(f"[{name} {lr:g}] training", flush=True)
                run(cfg, run_dir)
            row = {**measure(run_dir, label, cfg), "config_digest": digest,
                   "wall_s": round(time.perf_counter() - start, 1)}
            print(f"[{name} {lr:g}] {row['scored_by']} {row['score']:.3f}", flush=True)
            results.append(row)
            save(args.out, {"rows": results})
    save(args.out, {"rows": results})  # rows kept from the earlier file too
    table(results)


def table(results: list[dict]) -> None:
    by_row: dict[str, dict[float, dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], {})[r["lr"]] = r
    rates = sorted({r["lr"] for r in results})
    rows = []
    for name in (n for n in ROWS if n in by_row):
        cells = by_row[name]
        best = max(cells.values(), key=lambda r: r["score"])
        rows.append([ROWS[name][0], name, f"{best['lr']:g}", f"{best['score']:.3f}", best["scored_by"]]
                    + [f"**{cells[lr]['score']:.3f}**" if cells.get(lr) is best else
                       (f"{cells[lr]['score']:.3f}" if lr in cells else "") for lr in rates])
    print_table(["kind", "name", "starting lr", "score", "scored by", *[f"{lr:g}" for lr in rates]], rows)


if __name__ == "__main__":
    main()
