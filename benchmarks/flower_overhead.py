"""Round time of the Flower deployment runtime against the embedded runtime on the same work.

    python benchmarks/flower_overhead.py --rounds 6 --out benchmarks/results/flower_overhead.json

The same config (MiniLM-L6 + LoRA r=16 on MNLI, 100 clients, 2 per round, FedAvg, evaluation only
after the last round) runs on the embedded runtime and on a local Flower deployment (a SuperLink and
2 SuperNodes on loopback, each serving 50 clients, fedpeft's ServerApp and ClientApp) twice: with
Flower's default of a fresh ClientApp process per message, and with fedpeft's long-lived ClientApp
workers (``runtime.flower.warm_clients``, the default). All runs must reach the same accuracy to
within one evaluation example (checked; ClientApps train with one math thread each here). Per round (round 1 is left out as warm-up) we report:

* round time: the server's wall time from sending the payloads to having every update back,
  excluding evaluation and aggregation;
* client compute: the local training seconds the clients report (sum over the round's clients);
* ClientApp process time and setup time (Flower only): from the process start to its reply, and to
  the start of training (interpreter, imports, model and data), per client; and Flower's latency
  around it: from the server pushing the message to the ClientApp process starting, and from the
  ClientApp's reply to the server pulling it;
* overhead = round time - client compute;
* peak memory: the largest total RSS of every process of the run (Flower: launcher, SuperLink,
  SuperNodes, SuperExec, ServerApp and ClientApps), sampled every 0.1 s.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import psutil

from fedpeft.config import load_config
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.runtime.flower.launch import LocalDeployment, run_flower

from results_io import save  # benchmarks/results_io.py

BASE = [
    "name=flower-overhead", "model.name=minilm-l6", "task.dataset=mnli", "task.train_split=train_subset",
    "task.eval_split=heldout_subset", "task.max_length=128", "federation.num_clients=100",
    "federation.clients_per_round=2", "train.batch_size=16", "train.lr=0.002", "eval.every=0",
    "eval.at_start=false", "eval.max_examples=200", "runtime.progress=false", "runtime.flops_sample_steps=0",
]


class PeakRSS:
    """Largest total RSS of this process and all its descendants, sampled in a thread."""

    def __init__(self, interval: float = 0.1):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def per_round(rows: list[dict]) -> dict:
    body = [r for r in rows if r.get("round", 0) >= 2]  # round 1 is warm-up
    round_s = [r["time_client_s"] for r in body]
    compute = [sum(float(v) for v in r["client_train_seconds"].values()) for r in body]
    out = {
        "rounds_measured": len(body),
        "round_s_median": statistics.median(round_s),
        "client_compute_s_median": statistics.median(compute),
        "overhead_s_median": statistics.median(a - b for a, b in zip(round_s, compute)),
        "round_s": round_s,
        "client_compute_s": compute,
    }
    if body and "client_process_s" in body[0]:
        out["clientapp_process_s_median"] = statistics.median(
            float(v) for r in body for v in r["client_process_s"].values())
        out["clientapp_setup_s_median"] = statistics.median(
            float(v) for r in body for v in r["client_setup_s"].values())
        out["start_delay_s_median"] = statistics.median(
            float(v) for r in body for v in r["client_start_delay_s"].values())
        out["return_delay_s_median"] = statistics.median(
            float(v) for r in body for v in r["client_return_delay_s"].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--runs", default="runs/flower_overhead")
    ap.add_argument("--out", default="benchmarks/results/flower_overhead.json")
    args = ap.parse_args()
    cfg = load_config(None, [*BASE, f"federation.rounds={args.rounds}"])
    runs = Path(args.runs)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = {}

    with PeakRSS() as mem:
        t0 = time.perf_counter()
        EmbeddedRuntime(cfg, runs / f"embedded-{stamp}").run()
        wall = time.perf_counter() - t0
    rows = read_metrics(runs / f"embedded-{stamp}")
    results["embedded"] = {**per_round(rows), "wall_s": wall, "peak_rss_mib": mem.peak / 2**20,
                           "final_accuracy": rows[-1]["eval_accuracy"]}

    for name, warm in (("flower (Flower's ClientApp process per message)", False),
                       ("flower (warm fedpeft ClientApp workers)", True)):
        tag = "warm" if warm else "stock"
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            with LocalDeployment(2, runs / f"flower-{tag}-{stamp}-logs", warm=warm) as dep:
                run_flower(cfg, runs / f"flower-{tag}-{stamp}", deployment=dep, log=lambda m: None)
            wall = time.perf_counter() - t0
        rows = read_metrics(runs / f"flower-{tag}-{stamp}")
        results[name] = {**per_round(rows), "wall_s": wall, "peak_rss_mib": mem.peak / 2**20,
                         "final_accuracy": rows[-1]["eval_accuracy"], "supernodes": 2, "warm_clients": warm}
        if abs(results[name]["final_accuracy"] - results["embedded"]["final_accuracy"]) > 0.011:
            raise SystemExit("the runtimes disagree on accuracy; the timing comparison would be meaningless")

    print("| runtime | round s (median) | client compute s | overhead s | ClientApp process s | ClientApp setup s "
          "| push to process start s | reply to server s | peak RSS MiB | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for name, r in results.items():
        print(f"| {name} | {r['round_s_median']:.2f} | {r['client_compute_s_median']:.2f} | "
              f"{r['overhead_s_median']:.2f} | {r.get('clientapp_process_s_median', nan):.2f} | "
              f"{r.get('clientapp_setup_s_median', nan):.2f} | {r.get('start_delay_s_median', nan):.2f} | "
              f"{r.get('return_delay_s_median', nan):.2f} | {r['peak_rss_mib']:.0f} | {r['wall_s']:.0f} |")
    save(args.out, {"command": f"python benchmarks/flower_overhead.py --rounds {args.rounds}", "config": BASE,
                    "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
