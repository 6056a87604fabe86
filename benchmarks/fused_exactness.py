"""How close a fused pass's updates are to one client at a time: each PEFT method that trains clients together,
on MiniLM-L6 (the quickstart's model and data), 4 clients of 5 local AdamW steps, every dropout off, trained
once one at a time and once 4 per pass; for each client the largest absolute difference of any trained entry,
its relative L2 gap (the difference against the change the client made), and whether any client came out
bit-identical.

    python benchmarks/fused_exactness.py --out benchmarks/results/fused_exactness.json

A fused pass computes each row with other matrix-product blockings (batched products, another padded length), so
float32 sums round differently; the figures say by how much. (tests/test_clients_per_pass.py checks the same on
a tiny model within its tolerances.)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from results_io import load_config, print_table, save  # benchmarks/results_io.py

from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.tuners import PEFT_METHODS

COMMON = ["model.name=minilm-l6", "task.dataset=sst2", "task.max_train_examples=320", "task.max_length=64",
          "federation.num_clients=4", "federation.clients_per_round=4", "federation.rounds=1",
          "train.local_steps=5", "train.batch_size=8", "model.dropout=0", "eval.every=0", "eval.max_examples=8",
          "runtime.progress=false", "runtime.flops_sample_steps=0"]


def updates(method: str, per_pass: int, run_dir: Path) -> tuple[dict[int, dict[str, np.ndarray]], dict[int, Any]]:
    """Each client's trained tensors after one round, and the round's payloads."""
    sets = [*COMMON, f"peft.method={method}", f"runtime.clients_per_pass={per_pass}"]
    cfg = load_config(None, sets)
    if "dropout" in type(cfg.peft).model_fields:
        cfg = load_config(None, [*sets, "peft.dropout=0"])
    runtime = EmbeddedRuntime(cfg, run_dir)
    try:
        payloads = runtime.server.configure(1, [0, 1, 2, 3])
        results = runtime.transport.run_clients(1, payloads)
    finally:
        runtime.close()
    out = {}
    for cid, (update, _, _, failure) in results.items():
        if failure is not None or update is None:
            raise SystemExit(f"{method}, {per_pass} per pass: client {cid} failed: {failure}")
        out[cid] = update.arrays
    return out, payloads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="*", default=None, help="PEFT methods (default: every one that trains "
                    "clients together)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    methods = args.methods or sorted(m for m in PEFT_METHODS.names() if PEFT_METHODS.get(m).trains_batched)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            alone, payloads = updates(method, 1, Path(tmp) / f"{method}-1")
            fused, _ = updates(method, 4, Path(tmp) / f"{method}-4")
            for cid in sorted(alone):
                a, f = alone[cid], fused[cid]
                gap = np.concatenate([(a[k].astype(np.float64) - f[k]).ravel() for k in a])
                change = np.concatenate([(a[k].astype(np.float64) - payloads[cid].arrays[k]).ravel() for k in a])
                rows.append({"method": method, "client": cid, "max_abs": float(np.abs(gap).max()),
                             "max_abs_entry": float(max(np.abs(a[k]).max() for k in a)),
                             "relative_l2": float(np.linalg.norm(gap) / np.linalg.norm(change)),
                             "identical": bool(all(np.array_equal(a[k], f[k]) for k in a))})
            print(f"[{method}] largest absolute difference "
                  f"{max(r['max_abs'] for r in rows if r['method'] == method):.2e}", flush=True)
    print_table(["method", "largest absolute difference", "largest relative L2 gap", "clients bit-identical"],
                [[m, f"{max(r['max_abs'] for r in rows if r['method'] == m):.1e}",
                  f"{max(r['relative_l2'] for r in rows if r['method'] == m):.1e}",
                  f"{sum(r['identical'] for r in rows if r['method'] == m)} of 4"] for m in methods])
    if args.out:
        save(args.out, {"config": COMMON, "clients_per_pass": [1, 4], "rows": rows})


if __name__ == "__main__":
    main()
