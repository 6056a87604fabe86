"""Peak memory (RSS) of the embedded runtime with 10, 100 and 1000 clients on the same data and work.

    python benchmarks/memory.py --out benchmarks/results/memory.json
    python benchmarks/memory.py --algorithms fedpeptao --clients 100,1000 --out benchmarks/results/memory_fedpeptao.json

Each run is a separate process (so peak RSS is its own): MiniLM-L6 + LoRA r16, MNLI train_subset
(8,999 pairs) split IID among N clients, 2 clients per round, 3 rounds. The runtime reports
``peak_rss_mb`` (getrusage ru_maxrss) in summary.json. FedPepTAO keeps state per client (control
variates on the server, the personal prompt on each client), so its setting is 20-token deep prompts,
10 clients per round and 5 rounds with the layers fixed after round 2 (half of them): 50 client
trainings, whatever the federation's size. Also reported: the size of the run's last checkpoint, which
holds the server's and the clients' state.
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
from results_io import print_table, save  # benchmarks/results_io.py

from fedpeft.config import apply_overrides

BASE = [
    "model.name=minilm-l6", "task.dataset=mnli", "task.train_split=train_subset", "task.eval_split=heldout_subset",
    "task.max_length=128", "federation.clients_per_round=2", "federation.rounds=3", "train.local_steps=5",
    "train.batch_size=8", "eval.every=0", "eval.max_examples=200", "runtime.progress=false",
]


ALGORITHMS = {
    "fedavg": ["algorithm.name=fedavg"],
    "fedadam": ["algorithm.name=fedadam"],
    "fedpeptao": ["algorithm.name=fedpeptao", "algorithm.ratio=0.5", "algorithm.selection_round=2",
                  "peft.method=prefix_tuning", "peft.num_virtual_tokens=20", "peft.projection=false",
                  "federation.clients_per_round=10", "federation.rounds=5", "train.optimizer=adamw", "train.lr=0.04"],
}


def run_one(num_clients: int, tmp: Path, algorithm: str) -> dict:
    run_dir = tmp / f"n{num_clients}-{algorithm}"
    sets = [*BASE, *ALGORITHMS[algorithm], f"federation.num_clients={num_clients}", f"name=mem{num_clients}"]
    config = tmp / f"n{num_clients}-{algorithm}.yaml"
    config.write_text(yaml.safe_dump(apply_overrides({}, sets)))
    cmd = [sys.executable, "-m", "fedpeft.cli", "run", str(config), "--run-dir", str(run_dir), "--no-progress"]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"num_clients": num_clients, "algorithm": algorithm, "peak_rss_mb": summary["peak_rss_mb"],
            "wall_s": summary["wall_s"], "checkpoint_mb": (run_dir / "checkpoint.safetensors").stat().st_size / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/memory.json")
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--algorithms", default="fedavg,fedadam")
    args = ap.parse_args()
    algorithms = args.algorithms.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in algorithms:
            for n in [int(x) for x in args.clients.split(",")]:
                rows.append(run_one(n, Path(tmp), algorithm))
                print(rows[-1], flush=True)
    for algorithm in algorithms:
        sub = [r for r in rows if r["algorithm"] == algorithm]
        base = sub[0]["peak_rss_mb"]
        for r in sub:
            r["ratio_to_smallest"] = r["peak_rss_mb"] / base
    save(args.out, {"config": BASE, "algorithms": {a: ALGORITHMS[a] for a in algorithms}, "rows": rows})
    print_table(["algorithm", "clients", "peak RSS (MiB)", "ratio to the fewest clients", "checkpoint (MiB)"],
                [[r["algorithm"], r["num_clients"], f"{r['peak_rss_mb']:.0f}", f"{r['ratio_to_smallest']:.3f}",
                  f"{r['checkpoint_mb']:.1f}"] for r in rows])


if __name__ == "__main__":
    main()
