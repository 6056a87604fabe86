"""The papers in simulated time: paper 004 (full fine-tuning vs adapters vs LoRA) and paper 000 (head pruning and
loss-based client selection) on the clock of fedpeft's simulated systems (docs/guide/system.md).

    python benchmarks/papers_time.py paper004 --data text   # MiniLM-L6, 20 Newsgroups (configs/paper004_20news.yaml)
    python benchmarks/papers_time.py paper004 --data vit    # the MNIST ViT (configs/mnist_vit_adapters.yaml;
                                                            #   first: python benchmarks/mnist_vit.py prepare)
    python benchmarks/papers_time.py paper000               # 100 MNLI clients, 2 a round (paper000_mnli_heads.yaml)

Other seeds: ``--set seed=1 --runs runs/papers_time_s1 --out benchmarks/results/papers_time_paper004_vit_s1.json``;
``--table`` then prints the mean and spread over the result files given to ``--out`` (comma-separated).

Paper 004's runs have every client in every round, as the paper's: each method trains once (the ideal profile) and
its rounds are replayed (fedpeft.runtime.simclock.replay: the runtime's own clock on the bytes and FLOPs each
client counted, exact because a system whose clients are always online changes no client's training) on two
systems: ``datacenter`` and ``mobile-online``, the mobile profile's phones and 4G links (drawn from the run's seed)
written to a trace without online windows. Paper 000's runs select 2 of 100 clients a round, so clients that come
and go change who trains: each arm runs on the ideal profile (replayed on ``datacenter``) and again on the
``mobile`` profile itself (phones online one window a day). Simulated time is the runtime's: counted FLOPs at the
device's speed (torch's flop counter on sampled steps: masked heads execute the dense computation) and the measured
payload bytes over the links. The host's speed changes none of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from mnist_vit import METHODS as VIT_METHODS  # benchmarks/mnist_vit.py
from paper000 import B1, METHOD, SELECTIONS  # benchmarks/paper000.py
from paper000 import CONFIG as PAPER000_CONFIG
from paper004 import METHODS as TEXT_METHODS  # benchmarks/paper004.py
from results_io import load_config, print_table, save, train_or_reuse  # benchmarks/results_io.py

from fedpeft.rundir import read_metrics
from fedpeft.runtime.simclock import replay
from fedpeft.system.devices import MBIT, draw_profile

PAPER004 = {  # the configs and learning rates of benchmarks/paper004.py and benchmarks/mnist_vit.py
    "text": ("configs/paper004_20news.yaml", TEXT_METHODS),
    "vit": ("configs/mnist_vit_adapters.yaml", VIT_METHODS),
}
PAPER000 = {  # benchmarks/paper000.py's arms
    "fedavg-random": [*B1, *SELECTIONS["random"]],
    "method-random": [*METHOD, *SELECTIONS["random"]],
    "method-loss": [*METHOD, *SELECTIONS["loss"]],
}
CLAIMS = {
    "paper004": "transmission time about 98% less with adapters than full fine-tuning; local training time 20-40% "
                "less (NLP); no training-time reduction observed on CV",
    "paper000": "up to 1.8x less communication and 3.9x fewer training OPs than full-network FedAvg; pruning and "
                "head-weighted aggregation speed up the early rounds, loss-based selection the later ones; 'the "
                "training time can be further improved with a custom implementation of pruned model training'",
}


def train(config: str, overrides: list[str], run_dir: Path, label: str):
    cfg = load_config(config, [*overrides, "runtime.progress=false"])  # last too: after the --set in overrides, as before
    train_or_reuse(cfg, run_dir, label, note=" ".join(overrides))
    return cfg, read_metrics(run_dir)


def mobile_online_trace(path: Path, num_clients: int, seed: int) -> Path:
    """The mobile profile's phones and links for ``num_clients`` (drawn from ``seed``) as a trace file without
    online windows: always online."""
    d = draw_profile("mobile", num_clients, seed)
    devices = [{"flops_per_s": float(d.flops_per_s[c]), "download_mbps": float(d.download_bytes_per_s[c] / MBIT),
                "upload_mbps": float(d.upload_bytes_per_s[c] / MBIT), "latency_s": float(d.latency_s[c])}
               for c in range(num_clients)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"devices": devices}))
    return path


def timeline(rows: list[dict[str, Any]], sim: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """One run's figures on one system: ``rows`` its metrics (accuracy, bytes), ``sim`` the sim keys per round.
    Per-round means are over the rounds that aggregated clients (their means are over those clients)."""
    by_round = {s["round"]: s for s in sim}
    train_rows = [r for r in rows if r["round"] > 0]
    aggregated = [r for r in train_rows if r["client_num_examples"]]
    if not aggregated or any(by_round[r["round"]]["sim_round_s"] is None for r in train_rows):
        raise SystemExit("no round aggregated a client, or the run counted no FLOPs (runtime.flops_sample_steps): "
                         "no simulated time to report")
    mean = lambda key: statistics.fmean(by_round[r["round"]][key] for r in aggregated)
    evals = [(r["round"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    hit = next((rnd for rnd, acc in evals if acc >= target), None)
    ups = [r["bytes_up"][c] for r in aggregated for c in r["client_num_examples"]]
    return {
        "final_accuracy": evals[-1][1], "best_accuracy": max(acc for _, acc in evals),
        "mib_up_per_client_round": statistics.fmean(ups) / 2**20,
        "clients_per_round": statistics.fmean(len(r["client_num_examples"]) for r in train_rows),
        "transmission_s_per_round": mean("sim_download_s") + mean("sim_upload_s"),
        "compute_s_per_round": mean("sim_compute_s"),
        "wait_s_per_round": mean("sim_wait_s"),
        "round_s": statistics.fmean(by_round[r["round"]]["sim_round_s"] for r in train_rows),
        "sim_hours": by_round[train_rows[-1]["round"]]["sim_time_s"] / 3600,
        "target": target,
        "rounds_to_target": hit,
        "hours_to_target": None if hit is None else by_round[hit]["sim_time_s"] / 3600,
        "eval_curve": evals,
    }


def sim_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k == "round" or k.startswith("sim_")} for r in rows]


def paper004(args: argparse.Namespace) -> dict[str, Any]:
    config, methods = PAPER004[args.data]
    out = []
    for method, overrides in methods.items():
        run_dir = Path(args.runs) / f"paper004-{args.data}" / method
        cfg, rows = train(config, [*overrides, f"name=paper004-{args.data}-{method}", *args.set], run_dir, method)
        trace = mobile_online_trace(Path(args.runs) / f"paper004-{args.data}" / "mobile_online.json",
                                    cfg.federation.num_clients, cfg.seed)
        systems = {"ideal": sim_of(rows),
                   "datacenter": replay(cfg.model_copy(update={"system": cfg.system.model_copy(
                       update={"profile": "datacenter"})}), rows),
                   "mobile-online": replay(cfg.model_copy(update={"system": cfg.system.model_copy(
                       update={"trace": str(trace)})}), rows)}
        for system, sim in systems.items():
            out.append({"data": args.data, "method": method, "system": system, "run_dir": str(run_dir),
                        **timeline(rows, sim, args.target)})
            print(json.dumps({k: v for k, v in out[-1].items() if k != "eval_curve"}), flush=True)
    full = {r["system"]: r for r in out if r["method"] == "full"}
    print_table(["method", "system", "MiB up / client / round", "transmission s / round", "vs full",
                 "compute s / round", "vs full", "round s", "final acc", f"s to {args.target}", "s in all"],
                [[r["method"], r["system"], f"{r['mib_up_per_client_round']:.3f}",
                  f"{r['transmission_s_per_round']:.3g}", _less(r, full[r["system"]], "transmission_s_per_round"),
                  f"{r['compute_s_per_round']:.3g}", _less(r, full[r["system"]], "compute_s_per_round"),
                  f"{r['round_s']:.3g}", f"{r['final_accuracy']:.4f}", _seconds(r["hours_to_target"]),
                  _seconds(r["sim_hours"])] for r in out if r["system"] != "ideal"])
    return {"data": args.data, "config": config, "methods": methods, "rows": out}


def paper000(args: argparse.Namespace) -> dict[str, Any]:
    config = PAPER000_CONFIG
    common = [f"federation.rounds={args.rounds}", f"eval.every={args.eval_every}", *args.set]
    out = []
    for arm in args.arms.split(","):
        overrides = PAPER000[arm]
        for profile in ("ideal", "mobile"):
            run_dir = Path(args.runs) / "paper000" / f"{arm}-{profile}"
            cfg, rows = train(config, [*common, *overrides, f"system.profile={profile}", f"name=paper000-{arm}-{profile}"],
                              run_dir, f"{arm}-{profile}")
            systems = {"mobile": sim_of(rows)} if profile == "mobile" else {
                "datacenter": replay(cfg.model_copy(update={"system": cfg.system.model_copy(
                    update={"profile": "datacenter"})}), rows)}
            train_rows = [r for r in rows if r["round"] > 0]
            ops_values = [v for r in train_rows for v in r["client_ops_analytic"].values() if v is not None]
            ops = statistics.fmean(ops_values) if ops_values else None  # (a method without analytic OPs: None)
            flops = statistics.fmean(v for r in train_rows for v in r["client_flops"].values() if v is not None)
            for system, sim in systems.items():
                out.append({"arm": arm, "system": system, "run_dir": str(run_dir),
                            "ops_analytic_g": None if ops is None else ops / 1e9,
                            "flops_measured_g": flops / 1e9, **timeline(rows, sim, args.target)})
                print(json.dumps({k: v for k, v in out[-1].items() if k != "eval_curve"}), flush=True)
    print_table(["arm", "system", "clients / round", "MiB up / client / round", "analytic GOPs / client / round",
                 "measured GFLOPs", "transmission s / round", "compute s / round", "round s", "final acc",
                 f"rounds to {args.target}", f"s to {args.target}", "s in all"],
                [[r["arm"], r["system"], f"{r['clients_per_round']:.2f}", f"{r['mib_up_per_client_round']:.3f}",
                  "n/a" if r["ops_analytic_g"] is None else f"{r['ops_analytic_g']:,.0f}", f"{r['flops_measured_g']:.0f}", f"{r['transmission_s_per_round']:.3g}",
                  f"{r['compute_s_per_round']:.3g}", f"{r['round_s']:.3g}", f"{r['final_accuracy']:.4f}",
                  "not reached" if r["rounds_to_target"] is None else r["rounds_to_target"], _seconds(r["hours_to_target"]), _seconds(r["sim_hours"])]
                 for r in out])
    return {"config": config, "rounds": args.rounds, "eval_every": args.eval_every,
            "arms": {arm: PAPER000[arm] for arm in args.arms.split(",")}, "rows": out}


def seeds_table(saved: list[dict[str, Any]]) -> None:
    """Per method (or arm) and system: mean +- population standard deviation over the seeds' result files of the
    final accuracy, the rounds and simulated seconds to the target (over the seeds that reached it) and the
    seconds in all."""
    if not saved or len({(s["experiment"], s.get("data"), s["target"]) for s in saved}) != 1:
        raise SystemExit("--table: give --out one or more result files of the same experiment, data and target")
    key = "method" if saved[0]["experiment"] == "paper004" else "arm"
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in saved:
        for r in s["rows"]:
            if r["system"] != "ideal":
                groups.setdefault((r[key], r["system"]), []).append(r)

    def spread(values: list[float], fmt: str) -> str:
        return f"{statistics.mean(values):{fmt}} +- {statistics.pstdev(values):{fmt}}" if values else "not reached"

    target, table = saved[0]["target"], []
    for (name, system), rows in groups.items():
        hit = [r for r in rows if r["rounds_to_target"] is not None]
        table.append([name, system, len(rows), spread([r["final_accuracy"] for r in rows], ".4f"),
                      f"{spread([r['rounds_to_target'] for r in hit], '.1f')} ({len(hit)} of {len(rows)})",
                      spread([3600 * r["hours_to_target"] for r in hit], ".4g"),
                      spread([3600 * r["sim_hours"] for r in rows], ".4g")])
    print_table([key, "system", "seeds", "final acc", f"rounds to {target}", f"s to {target}", "s in all"], table)


def _less(row: dict[str, Any], full: dict[str, Any], key: str) -> str:
    return "-" if row is full or not full[key] else f"{100 * (1 - row[key] / full[key]):.1f}% less"


def _seconds(hours: float | None) -> str:
    """Simulated hours as seconds (the small models here take seconds to hours)."""
    return "not reached" if hours is None else f"{3600 * hours:,.4g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("experiment", choices=("paper004", "paper000"))
    ap.add_argument("--data", choices=tuple(PAPER004), default="text", help="paper004: text or vit")
    ap.add_argument("--runs", default="runs/papers_time")
    ap.add_argument("--target", type=float, help="accuracy for the time to target (default: paper004 text 0.40, "
                    "vit 0.90; paper000 0.45)")
    ap.add_argument("--rounds", type=int, default=40, help="paper000: rounds")
    ap.add_argument("--eval-every", type=int, default=5, help="paper000: evaluation every N rounds")
    ap.add_argument("--arms", default=",".join(PAPER000), help="paper000: which arms")
    ap.add_argument("--set", action="append", default=[], help="a config override for every run")
    ap.add_argument("--out", help="the results file; with --table, several (comma-separated), one per seed")
    ap.add_argument("--table", action="store_true", help="print the mean +- spread over the seeds in --out's files")
    args = ap.parse_args()
    if args.table:
        seeds_table([json.loads(Path(f).read_text()) for f in (args.out or "").split(",") if f])
        return
    if args.target is None:
        args.target = {"text": 0.40, "vit": 0.90}[args.data] if args.experiment == "paper004" else 0.45
    result = paper004(args) if args.experiment == "paper004" else paper000(args)
    name = f"papers_time_paper004_{args.data}" if args.experiment == "paper004" else "papers_time_paper000"
    save(args.out or f"benchmarks/results/{name}.json", {"experiment": args.experiment, "claims": CLAIMS[args.experiment],
                                                         "target": args.target, "overrides": args.set, **result})


if __name__ == "__main__":
    main()
