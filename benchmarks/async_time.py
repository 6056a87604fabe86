"""Time on the simulated clock: buffered asynchronous aggregation at scale, and FedBuff against synchronous
FedAvg on a cross-device federation.

    python benchmarks/async_time.py scale --out benchmarks/results/async_scale.json
    python benchmarks/async_time.py fedbuff --out benchmarks/results/async_fedbuff.json

``scale``: FedBuff (100 clients training at once, buffer of 10, 10 aggregations) with 1,000 and with 10,000
clients on the mobile profile, each run in its own process so that its peak RSS is its own. MiniLM-L6 + LoRA r8
on 20,000 SST-2 rows; every training is one local step on 2 rows, so both runs do the same work (100 clients to
start, then 10 per aggregation) and differ only in the number of idle clients. Reported: peak RSS, and the
schedule's own host seconds per aggregation (events, selection, rebasing: ``time_schedule_s``) against the
host seconds the clients trained (``time_client_s`` less it).

``fedbuff``: 1,000 clients on the mobile profile, SST-2 split IID (20 rows each), MiniLM-L6 + LoRA r16, one local
epoch. Synchronous FedAvg with 10 clients a round against FedBuff with 30 clients training at once and a buffer
of 10 (so both step the model on 10 updates), the same number of model steps, three seeds each. Reported: the
accuracy every 2 steps against simulated seconds, and the simulated time to 0.75 accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from results_io import print_table, save  # benchmarks/results_io.py

from fedpeft.config import apply_overrides

MODEL = ["model.name=minilm-l6", "task.dataset=sst2", "task.max_length=64", "peft.method=lora",
         "eval.max_examples=300", "eval.batch_size=64", "runtime.progress=false", "system.profile=mobile"]
SCALE = [*MODEL, "peft.r=8", "task.max_train_examples=20000", "train.local_steps=1", "train.batch_size=2",
         "federation.clients_per_round=100", "federation.rounds=10", "eval.every=0",
         "federation.asynchronous={rule: fedbuff, buffer_size: 10}", "runtime.checkpoint_every=0"]
CROSS_DEVICE = [*MODEL, "peft.r=16", "peft.alpha=32", "task.max_train_examples=20000", "federation.num_clients=1000",
                "train.local_epochs=1", "train.batch_size=8", "train.lr=0.001", "eval.every=2", "eval.target=0.75",
                "runtime.checkpoint_every=0"]
SCHEDULES = {
    "sync FedAvg (10 a round)": ["federation.clients_per_round=10"],
    "FedBuff (30 at once, K=10)": ["federation.clients_per_round=30",
                                   "federation.asynchronous={rule: fedbuff, buffer_size: 10}"],
}


def run(sets: list[str], run_dir: Path) -> tuple[dict, list[dict]]:
    """One run in its own process: (summary.json, metrics rows)."""
    config = run_dir.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(apply_overrides({}, sets)))
    cmd = [sys.executable, "-m", "fedpeft.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    done = subprocess.run(cmd, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), rows


def scale(args: argparse.Namespace) -> None:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.clients.split(",")]:
            summary, rows = run([*SCALE, f"federation.num_clients={n}", f"name=scale{n}"], Path(tmp) / f"n{n}")
            steps = rows[1:]
            schedule = [r["time_schedule_s"] for r in steps]
            training = [r["time_client_s"] - r["time_schedule_s"] for r in steps]
            out.append({"num_clients": n, "peak_rss_mb": summary["peak_rss_mb"], "wall_s": summary["wall_s"],
                        "aggregations": len(steps), "trainings": sum(r["async_started"] for r in steps),
                        "schedule_s_per_aggregation": statistics.mean(schedule),
                        "training_s_per_aggregation": statistics.mean(training),
                        "schedule_share": sum(schedule) / sum(training), "sim_time_s": summary["sim_time_s"]})
            print(out[-1], flush=True)
    for r in out:
        r["rss_ratio_to_fewest"] = r["peak_rss_mb"] / out[0]["peak_rss_mb"]
    save(args.out, {"config": SCALE, "rows": out})
    print_table(["clients", "peak RSS (MiB)", "ratio", "trainings", "schedule s / aggregation",
                 "training s / aggregation", "schedule share"],
                [[r["num_clients"], f"{r['peak_rss_mb']:.0f}", f"{r['rss_ratio_to_fewest']:.3f}", r["trainings"],
                  f"{r['schedule_s_per_aggregation']:.4f}", f"{r['training_s_per_aggregation']:.2f}",
                  f"{r['schedule_share']:.2%}"] for r in out])


def fedbuff(args: argparse.Namespace) -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, sets in SCHEDULES.items():
            if args.only and args.only not in label:
                continue
            for seed in [int(s) for s in args.seeds.split(",")]:
                name = f"{'sync' if 'sync' in label else 'fedbuff'}-s{seed}"
                summary, rows = run([*CROSS_DEVICE, *sets, f"federation.rounds={args.steps}", f"seed={seed}",
                                     f"name={name}"], Path(tmp) / name)
                curve = [[r["round"], r["sim_time_s"], r["eval_accuracy"]] for r in rows if "eval_accuracy" in r]
                results.append({"schedule": label, "seed": seed, "curve": curve, "final": summary["final"],
                                "sim_time_s": summary["sim_time_s"],
                                "sim_time_to_target_s": summary["sim_time_to_target_s"],
                                "rounds_to_target": summary["rounds_to_target"], "wall_s": summary["wall_s"]})
                print({k: v for k, v in results[-1].items() if k != "curve"}, flush=True)
    save(args.out, {"config": CROSS_DEVICE, "schedules": SCHEDULES, "steps": args.steps, "runs": results})
    fedbuff_table(results, args.steps)


def fedbuff_table(results: list[dict], steps: int) -> None:
    """Per schedule, mean +- standard deviation over the seeds (simulated seconds)."""
    table = []
    for label in SCHEDULES:
        runs = [r for r in results if r["schedule"] == label]
        if not runs:
            continue
        finals = [r["final"] for r in runs]
        total = [r["sim_time_s"] for r in runs]
        hit = [r["sim_time_to_target_s"] for r in runs if r["sim_time_to_target_s"] is not None]
        table.append([label, f"{statistics.mean(finals):.4f} +- {statistics.pstdev(finals):.4f}",
                      f"{statistics.mean(total):.1f} +- {statistics.pstdev(total):.1f}",
                      (f"{statistics.mean(hit):.1f} +- {statistics.pstdev(hit):.1f} ({len(hit)} of {len(runs)} seeds)"
                       if hit else f"not reached (0 of {len(runs)} seeds)")])
    print_table(["schedule", f"accuracy after {steps} steps", "simulated s", "simulated s to 0.75"], table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("scale", help="peak RSS and the schedule's cost at 1,000 and 10,000 clients")
    a.add_argument("--clients", default="1000,10000")
    a.add_argument("--out", default="benchmarks/results/async_scale.json")
    b = sub.add_parser("fedbuff", help="synchronous FedAvg against FedBuff on 1,000 phones")
    b.add_argument("--seeds", default="0,1,2")
    b.add_argument("--steps", type=int, default=20, help="model steps (rounds or aggregations)")
    b.add_argument("--out", default="benchmarks/results/async_fedbuff.json")
    b.add_argument("--only", default="", help="run only the schedules whose label holds this text (e.g. FedBuff)")
    b.add_argument("--table", action="store_true", help="print the table of the results in --out (several files: "
                   "comma-separated, runs of the same number of steps), run nothing")
    args = ap.parse_args()
    if args.what == "fedbuff" and args.table:
        saved = [json.loads(Path(path).read_text()) for path in args.out.split(",")]
        if len({s["steps"] for s in saved}) != 1:
            raise SystemExit(f"--table: the files in --out ran different numbers of steps: {args.out}")
        fedbuff_table([run for s in saved for run in s["runs"]], saved[0]["steps"])
        return
    scale(args) if args.what == "scale" else fedbuff(args)


if __name__ == "__main__":
    main()
