"""Round time of the Flower deployment runtime against the embedded runtime on the same work.

    python benchmarks/flower_overhead.py --rounds 6 --out benchmarks/results/flower_overhead.json

The same config (MiniLM-L6 + LoRA r=16 on MNLI, 100 clients, 2 per round, FedAvg, evaluation only
after the last round) runs on the embedded runtime and on a local Flower deployment (a SuperLink and
2 SuperNodes on loopback, each serving 50 clients, fedpeft's ServerApp and ClientApp) three times:
stock Flower (a fresh ClientApp process per message, the SuperNode's fixed 3 s idle poll), with
fedpeft's long-lived ClientApp workers (``runtime.flower.warm_clients``), and with those workers and
SuperNodes started through ``fedpeft.runtime.flower.fast_supernode`` (0.1 s poll; both are the
defaults). Last, the CPU an idle deployment burns on polling, with Flower's 3 s SuperNode poll and
with 0.1 s. All runs must reach the same accuracy to
within one evaluation example (checked; ClientApps train with one math thread each here). Per round (round 1 is left out as warm-up) we report:

* round time: the server's wall time from sending the payloads to having every update back,
  excluding evaluation and aggregation;
* client compute: the local training seconds the clients report (sum over the round's clients);
* ClientApp process time and setup time (Flower only): from the process start to its reply, and to
  the start of training (interpreter, imports, model and data), per client; and Flower's latency
  around it: from the server pushing the message to the ClientApp process starting, and from the
  ClientApp's reply to the server pulling it;
* round beyond training = round time - the training it waits for (embedded: the clients' sum, one after
  another; Flower: the slowest client, since SuperNodes train at the same time);
* bytes up and down per round (all clients; under SecAgg+ every message of the protocol);
* peak memory: the largest total RSS of every process of the run (Flower: launcher, SuperLink,
  SuperNodes, SuperExec, ServerApp and ClientApps; simulation: also Ray's processes), sampled every 0.1 s.

Then the same work on Flower's Ray simulation engine (2 virtual SuperNodes, one core per ClientApp
actor), and, since SecAgg+ needs a SuperNode per client, 4 clients on 4 warm SuperNodes with and
without secure aggregation, beside the embedded runtime on those 4 clients (360 training pairs, 90
per client as in the 100-client runs; they train other clients, so they are compared among themselves).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import psutil
from results_io import PeakRSS, save  # benchmarks/results_io.py

from fedpeft.config import load_config
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.runtime.flower.launch import LocalDeployment, run_flower

BASE = [
    "name=flower-overhead", "model.name=minilm-l6", "task.dataset=mnli", "task.train_split=train_subset",
    "task.eval_split=heldout_subset", "task.max_length=128", "federation.num_clients=100",
    "federation.clients_per_round=2", "train.batch_size=16", "train.lr=0.002", "eval.every=0",
    "eval.at_start=false", "eval.max_examples=200", "runtime.progress=false", "runtime.flops_sample_steps=0",
]


def idle_cpu(supernode_poll_s: float | None, log_dir: Path, seconds: float = 20.0) -> float:
    """CPU time that an idle local deployment (SuperLink, 2 SuperNodes with warm workers, and everything
    they started) uses per second of wall time, in percent of one core, after 8 s to settle."""
    with LocalDeployment(2, log_dir, supernode_poll_s=supernode_poll_s) as dep:
        time.sleep(8)
        family = []
        for proc in [dep.superlink, *dep.supernodes, *dep.workers]:
            parent = psutil.Process(proc.pid)
            family += [parent, *parent.children(recursive=True)]
        start = {p.pid: sum(p.cpu_times()[:2]) for p in family}
        time.sleep(seconds)
        used = sum(sum(p.cpu_times()[:2]) - start[p.pid] for p in family if p.is_running())
    return 100.0 * used / seconds


def per_round(rows: list[dict], concurrent: bool) -> dict:
    """Medians over rounds 2.. of a run's timings and bytes. ``concurrent``: the round's clients train at
    the same time (Flower: one per SuperNode), so the round waits for the slowest, not for their sum."""
    body = [r for r in rows if r.get("round", 0) >= 2]  # round 1 is warm-up
    round_s = [r["time_client_s"] for r in body]
    compute = [sum(float(v) for v in r["client_train_seconds"].values()) for r in body]
    critical = [max(float(v) for v in r["client_train_seconds"].values()) if concurrent else c
                for r, c in zip(body, compute)]
    out = {
        "rounds_measured": len(body),
        "round_s_median": statistics.median(round_s),
        "client_compute_s_median": statistics.median(compute),
        "client_train_s_median": statistics.median(float(v) for r in body for v in r["client_train_seconds"].values()),
        # round time beyond the training it waits for (the slowest client, or the sum when sequential)
        "overhead_s_median": statistics.median(a - b for a, b in zip(round_s, critical)),
        "bytes_up_per_round_median": statistics.median(r["bytes_up_total"] for r in body),
        "bytes_down_per_round_median": statistics.median(r["bytes_down_total"] for r in body),
        "round_s": round_s,
        "client_compute_s": compute,
    }
    if body and body[0].get("client_process_s"):  # (not reported under SecAgg+)
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

    def embedded(name: str, tag: str, cfg) -> None:
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            EmbeddedRuntime(cfg, runs / f"{tag}-{stamp}").run()
            wall = time.perf_counter() - t0
        rows = read_metrics(runs / f"{tag}-{stamp}")
        results[name] = {**per_round(rows, concurrent=False), "wall_s": wall, "peak_rss_mib": mem.peak / 2**20,
                         "final_accuracy": rows[-1]["eval_accuracy"]}

    embedded("embedded", "embedded", cfg)

    def flower(name: str, tag: str, cfg, reference: str, **deployment) -> None:
        """Run cfg on Flower: on a LocalDeployment(**deployment), or (no arguments) as cfg says."""
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            if deployment:
                with LocalDeployment(cfg.runtime.flower.num_supernodes, runs / f"{tag}-{stamp}-logs",
                                     **deployment) as dep:
                    run_flower(cfg, runs / f"{tag}-{stamp}", deployment=dep, log=lambda m: None)
            else:
                run_flower(cfg, runs / f"{tag}-{stamp}", log=lambda m: None)
            wall = time.perf_counter() - t0
        rows = read_metrics(runs / f"{tag}-{stamp}")
        results[name] = {**per_round(rows, concurrent=True), "wall_s": wall, "peak_rss_mib": mem.peak / 2**20,
                         "final_accuracy": rows[-1]["eval_accuracy"], "supernodes": cfg.runtime.flower.num_supernodes,
                         "engine": cfg.runtime.flower.engine, **deployment}
        if abs(results[name]["final_accuracy"] - results[reference]["final_accuracy"]) > 0.011:
            raise SystemExit(f"{name} and {reference} disagree on accuracy; the timing comparison would be meaningless")

    flower("flower, stock (a ClientApp process per message, 3 s SuperNode poll)", "flower-stock", cfg, "embedded",
           warm=False, supernode_poll_s=None)
    flower("flower, warm fedpeft ClientApp workers, 3 s SuperNode poll", "flower-warm", cfg, "embedded", warm=True,
           supernode_poll_s=None)
    flower("flower, warm workers + 0.1 s SuperNode poll (fedpeft default)", "flower-warm-fast", cfg, "embedded",
           warm=True, supernode_poll_s=0.1)
    simulation = load_config(None, [*BASE, f"federation.rounds={args.rounds}", "runtime.name=flower",
                                    "runtime.flower.engine=simulation", "runtime.flower.client_cpus=1"])
    flower("flower simulation engine (Ray, 2 virtual SuperNodes)", "flower-simulation", simulation, "embedded")
    # SecAgg+ needs a SuperNode per client: 4 clients, 2 per round, on 4 warm SuperNodes, with and without it
    # (360 training pairs: each client holds 90, as in the 100-client runs, so a round is the same work)
    four = [*BASE, f"federation.rounds={args.rounds}", "federation.num_clients=4", "task.max_train_examples=360",
            "runtime.name=flower", "runtime.flower.num_supernodes=4"]
    embedded("embedded, 4 clients", "embedded-4", load_config(None, four))
    flower("flower, 4 clients on 4 SuperNodes (warm)", "flower-4", load_config(None, four), "embedded, 4 clients",
           warm=True)
    flower("flower, 4 clients on 4 SuperNodes (warm) + SecAgg+", "flower-4-secagg",
           load_config(None, [*four, "runtime.flower.secure_aggregation.clipping_range=1.0"]),
           "flower, 4 clients on 4 SuperNodes (warm)", warm=True)

    print("| runtime | round s | training s per client | round beyond training s | push to ClientApp s "
          "| reply to server s | MB up / down per round | peak RSS MiB | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for name, r in results.items():
        print(f"| {name} | {r['round_s_median']:.2f} | {r['client_train_s_median']:.2f} | "
              f"{r['overhead_s_median']:.2f} | {r.get('start_delay_s_median', nan):.2f} | "
              f"{r.get('return_delay_s_median', nan):.2f} | {r['bytes_up_per_round_median'] / 2**20:.2f} / "
              f"{r['bytes_down_per_round_median'] / 2**20:.2f} | {r['peak_rss_mib']:.0f} | {r['wall_s']:.0f} |")
    idle = {("flower's 3 s" if poll is None else f"{poll:g} s"): idle_cpu(poll, runs / f"idle-{stamp}")
            for poll in (None, 0.1)}
    for poll, share in idle.items():
        print(f"idle deployment (SuperLink + 2 warm SuperNodes), SuperNode poll {poll}: {share:.0f}% of one core")
    save(args.out, {"idle_cpu_percent_of_one_core": idle, "command": f"python benchmarks/flower_overhead.py --rounds {args.rounds}", "config": BASE,
                    "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
