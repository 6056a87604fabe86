"""Paper 004 (federated learning with adapters) at this machine's scale: full fine-tuning vs Houlsby
and Pfeiffer adapters vs LoRA under FedAvg, MiniLM-L6 on 20 Newsgroups (configs/paper004_20news.yaml:
1,500 training documents over 10 IID clients, all 10 in each of 6 rounds, 128 tokens, evaluation on a
fixed 1,000-document subset of the official test split every 2 rounds).

    python benchmarks/paper004.py --out benchmarks/results/paper004.json

Learning rates per method (the paper does not give them): 1e-4 for full fine-tuning, 2e-3 for the
adapters and LoRA. Reported per method: final accuracy, bytes per client per round (measured), total
transmission measured and by the paper's Eq. 1 (T = 2 x rounds x clients x C), local training time per
client and round.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from results_io import load_config, save  # benchmarks/results_io.py

from fedpeft.metrics.accounting import total_transmission
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import run

METHODS = {
    "full": ["peft={method: full}", "train.lr=0.0001"],
    "houlsby": ["peft={method: houlsby, reduction_factor: 16}", "train.lr=0.002"],
    "pfeiffer": ["peft={method: pfeiffer, reduction_factor: 16}", "train.lr=0.002"],
    "lora": ["peft={method: lora, r: 16, alpha: 32}", "train.lr=0.002"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/paper004_20news.yaml")
    ap.add_argument("--runs", default="runs/paper004")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default="benchmarks/results/paper004.json")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    rows = []
    for method in args.methods.split(","):
        cfg = load_config(args.config, [*METHODS[method], f"name=paper004-{method}", *args.set])
        run_dir = Path(args.runs) / method
        summary = run(cfg, run_dir)
        metrics = [r for r in read_metrics(run_dir) if r["round"] > 0]
        per_client = [s for r in metrics for s in r["client_train_seconds"].values()]
        c_up = summary["mean_bytes_up_per_client_round"]
        rows.append({
            "method": method,
            "initial_accuracy": summary["initial"],
            "final_accuracy": summary["final"],
            "best_accuracy": summary["best"],
            "trainable_parameters": summary["trainable_parameters"],
            "bytes_up_per_client_round": c_up,
            "bytes_down_per_client_round": summary["mean_bytes_down_per_client_round"],
            "total_bytes_measured": summary["total_bytes"],
            "total_bytes_eq1": total_transmission(summary["rounds"], cfg.federation.clients_per_round, c_up),
            "local_train_s_per_client_round_median": statistics.median(per_client),
            "client_compute_s_per_round_mean": summary["time_client_s"] / summary["rounds"],
            "run_dir": str(run_dir),
        })
        print(rows[-1], flush=True)
    save(args.out, {"config": args.config, "methods": METHODS, "rows": rows})
    full = next((r for r in rows if r["method"] == "full"), None)
    print("| method | trainable params | final acc | best acc | MiB up / client / round | total MiB (measured) | "
          "total MiB (Eq. 1) | local train s / client / round |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rel = ""
        if full and r is not full:
            rel = f" ({100 * (1 - r['bytes_up_per_client_round'] / full['bytes_up_per_client_round']):.1f}% less)"
        print(f"| {r['method']} | {r['trainable_parameters']:,} | {r['final_accuracy']:.4f} | {r['best_accuracy']:.4f} | "
              f"{r['bytes_up_per_client_round'] / 2**20:.3f}{rel} | {r['total_bytes_measured'] / 2**20:,.1f} | "
              f"{r['total_bytes_eq1'] / 2**20:,.1f} | {r['local_train_s_per_client_round_median']:.2f} |")


if __name__ == "__main__":
    main()
