"""Peak memory (RSS) of the embedded runtime with 10, 100 and 1000 clients on the same data and work.

    python benchmarks/memory.py --out benchmarks/results/memory.json

Each run is a separate process (so peak RSS is its own): MiniLM-L6 + LoRA r16, MNLI train_subset
(8,999 pairs) split IID among N clients, 2 clients per round, 3 rounds. The runtime reports
``peak_rss_mb`` (getrusage ru_maxrss) in summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from fedpeft.config import apply_overrides

from results_io import print_table, save  # benchmarks/results_io.py

BASE = [
    "model.name=minilm-l6", "task.dataset=mnli", "task.train_split=train_subset", "task.eval_split=heldout_subset",
    "task.max_length=128", "federation.clients_per_round=2", "federation.rounds=3", "train.local_steps=5",
    "train.batch_size=8", "eval.every=0", "eval.max_examples=200", "runtime.progress=false",
]


def run_one(num_clients: int, tmp: Path, algorithm: str) -> dict:
    run_dir = tmp / f"n{num_clients}-{algorithm}"
    sets = [*BASE, f"federation.num_clients={num_clients}", f"algorithm.name={algorithm}", f"name=mem{num_clients}"]
    config = tmp / f"n{num_clients}-{algorithm}.yaml"
    config.write_text(yaml.safe_dump(apply_overrides({}, sets)))
    cmd = [sys.executable, "-m", "fedpeft.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"num_clients": num_clients, "algorithm": algorithm, "peak_rss_mb": summary["peak_rss_mb"],
            "wall_s": summary["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/memory.json")
    ap.add_argument("--clients", default="10,100,1000")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in ("fedavg", "fedadam"):
            for n in [int(x) for x in args.clients.split(",")]:
                rows.append(run_one(n, Path(tmp), algorithm))
                print(rows[-1], flush=True)
    for algorithm in ("fedavg", "fedadam"):
        sub = [r for r in rows if r["algorithm"] == algorithm]
        base = sub[0]["peak_rss_mb"]
        for r in sub:
            r["ratio_to_smallest"] = r["peak_rss_mb"] / base
    save(args.out, {"config": BASE, "rows": rows})
    print_table(["algorithm", "clients", "peak RSS (MiB)", "ratio to 10 clients"],
                [[r["algorithm"], r["num_clients"], f"{r['peak_rss_mb']:.0f}", f"{r['ratio_to_smallest']:.3f}"] for r in rows])


if __name__ == "__main__":
    main()
