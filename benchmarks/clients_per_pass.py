"""A round's clients trained together (``runtime.clients_per_pass``) against one after another, Flower's Ray
simulation engine on the same work, and the throughput limit: one model trained centrally on the same rows.

    python benchmarks/clients_per_pass.py --out benchmarks/results/clients_per_pass.json
    python benchmarks/clients_per_pass.py --scenario cross-device --per-pass 1 8 32   # a subset

Scenarios (MiniLM-L6 + LoRA r8 on q, v; SmolLM2-135M + LoRA r8 on its default targets; MNLI pairs; AdamW; no
evaluation until the end, which is not timed):

* cross-device: 1,000 clients of 10 examples, 50 per round, one local epoch of batches of 8 (8 + 2 rows);
* cross-silo: 10 clients, 4 per round, 20 local steps of batches of 8 each (MiniLM-L6, then SmolLM2-135M).

Every setting runs in its own process (so that its peak memory is its own): one-at-a-time (``1``), the
clients-per-pass values asked for (``K``: one process; ``wN`` or ``wNxK``: ``runtime.workers`` N, each with
clients_per_pass K, 1 if not given; ``auto`` for either), Flower's simulation engine (2 virtual SuperNodes, one CPU each, as
``benchmarks/flower_overhead.py`` runs it), and the limit: a bare PyTorch loop (``limit``) that trains one copy
of the same model on every row the round's clients train on, in length-grouped batches of clients_per_pass x 8
rows, with one AdamW, padding each batch to its longest row, for each clients_per_pass measured (two batches
of warm-up, then one epoch timed). A fused pass
cannot beat it: it is the same arithmetic without the per-client tensors.

Per setting: round time (median over the rounds after the first, which is warm-up; the clients' training, from
sending the payloads to having every update), examples per second, the fraction of the best limit (the fastest of
the batch sizes timed), peak RSS and peak PSS of the process and all its children (PSS counts a page the workers share with the
run's process once; RSS counts it in each) and peak GPU memory on CUDA, and the share of padded tokens
in what was computed (fused passes) next to the share the clients would have padded alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BATCH = 8
SCENARIOS: dict[str, dict[str, Any]] = {
    "cross-device": {
        "model": "minilm-l6", "rounds": 3, "clients_per_round": 50,
        "overrides": ["federation.num_clients=1000", "federation.clients_per_round=50", "task.max_train_examples=10000",
                      "train.local_epochs=1"],
        "per_pass": ["1", "2", "4", "8", "16", "32", "auto", "w2x16", "w2x32", "wautoxauto"],
    },
    "cross-silo-minilm": {
        "model": "minilm-l6", "rounds": 3, "clients_per_round": 4,
        "overrides": ["federation.num_clients=10", "federation.clients_per_round=4", "task.max_train_examples=2000",
                      "train.local_steps=20"],
        "per_pass": ["1", "2", "4", "auto", "w2", "w2x2", "wautoxauto"],
    },
    "cross-silo-smollm2": {
        "model": "smollm2-135m", "rounds": 2, "clients_per_round": 4,
        "overrides": ["federation.num_clients=10", "federation.clients_per_round=4", "task.max_train_examples=2000",
                      "train.local_steps=20"],
        "per_pass": ["1", "2", "4", "auto", "w2", "wautoxauto"],
    },
}


EXTRA: list[str] = []  # --set overrides, for every setting


def parse_setting(one: str) -> tuple[str, str]:
    """A setting's (workers, clients per pass): ``K`` -> (1, K); ``wN`` -> (N, 1); ``wNxK`` -> (N, K)."""
    if not one.startswith("w"):
        return "1", one
    workers, _, per_pass = one[1:].partition("x")
    return workers, per_pass or "1"


def config(scenario: str, setting: str, device: str) -> Any:
    from fedpeft.config import load_config

    workers, per_pass = parse_setting(setting)
    s = SCENARIOS[scenario]
    return load_config(None, [
        f"name=clients-per-pass-{scenario}", f"model.name={s['model']}", "task.dataset=mnli",
        "task.train_split=train_subset", "task.eval_split=heldout_subset", "task.max_length=128",
        "peft.method=lora", "peft.r=8", f"train.batch_size={BATCH}", "train.lr=0.0005", f"federation.rounds={s['rounds']}",
        "eval.every=0", "eval.at_start=false", "eval.max_examples=64", "runtime.progress=false",
        "runtime.flops_sample_steps=0", f"runtime.device={device}", *s["overrides"],
        *([] if per_pass in ("flower", "limit") else [f"runtime.clients_per_pass={per_pass}"]),
        *([] if workers == "1" else [f"runtime.workers={workers}"]), *EXTRA,
    ])


def run_setting(scenario: str, per_pass: str, device: str, run_dir: Path) -> dict[str, Any]:
    """One setting, in this process: its per-round figures."""
    import torch
    from results_io import PeakRSS  # benchmarks/results_io.py

    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import EmbeddedRuntime
    from fedpeft.runtime.flower.launch import run_flower

    cfg = config(scenario, per_pass, device)
    if per_pass == "flower":
        cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={
            "name": "flower", "flower": cfg.runtime.flower.model_copy(update={"engine": "simulation",
                                                                              "client_cpus": 1})})})
    with PeakRSS(pss=True) as mem:
        t0 = time.perf_counter()
        if per_pass == "flower":
            run_flower(cfg, run_dir, log=lambda m: None)
        else:
            EmbeddedRuntime(cfg, run_dir).run()
        wall = time.perf_counter() - t0
    rows = [r for r in read_metrics(run_dir) if r.get("round", 0) >= 2]  # round 1: warm-up
    round_s = statistics.median(r["time_client_s"] for r in rows)
    steps = cfg.train.local_steps  # examples trained: local_steps batches of 8 each, or every example once
    examples = statistics.median(sum(n if steps is None else steps * BATCH for n in r["client_num_examples"].values())
                                 for r in rows)
    out: dict[str, Any] = {
        "round_s": round_s, "examples_per_round": examples, "examples_per_s": examples / round_s,
        "peak_rss_mib": mem.peak / 2**20, "peak_pss_mib": mem.peak_pss / 2**20, "wall_s": wall, "rounds_measured": len(rows),
        "padded_share": statistics.median(r["fused_padded_share"] for r in rows) if "fused_padded_share" in rows[0]
        else None,
        "alone_padded_share": statistics.median(r["alone_padded_share"] for r in rows) if "alone_padded_share" in
        rows[0] else None,
        "clients_per_pass": rows[0].get("clients_per_pass"), "workers": rows[0].get("workers", 1),
    }
    if device == "cuda":
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20  # (the run's process)
        out["worker_gpu_mib"] = max((r.get("worker_accelerator_mb") or 0.0 for r in rows), default=0.0) or None
    return out


def run_limit(scenario: str, device: str, batch_rows: list[int]) -> dict[str, Any]:
    """The bare loop: one model, the rows of one round's clients, batches of ``n`` rows for each n."""
    import numpy as np
    import torch

    from fedpeft.algorithms.base import random_selection
    from fedpeft.data.batching import Encoded, collate, length_grouped_batches
    from fedpeft.runtime.setup import build_experiment

    cfg = config(scenario, "limit", device)
    exp = build_experiment(cfg)
    s = SCENARIOS[scenario]
    cids = random_selection(cfg.federation.num_clients, s["clients_per_round"], cfg.seed, 2)
    steps = cfg.train.local_steps
    rows_data = []  # the rows the round's clients train on: every example once, or local_steps batches of 8
    for c in cids:
        d = exp.client_data(c)
        rows_data.append(d.subset(np.arange(len(d) if steps is None else min(len(d), steps * BATCH))))
    merged = Encoded(input_ids=[x for d in rows_data for x in d.input_ids], labels=[y for d in rows_data for y in d.labels],
                     token_type_ids=None if rows_data[0].token_type_ids is None else
                     [t for d in rows_data for t in d.token_type_ids])
    model = exp.tuned.module
    params = list(exp.tuned.params.values())
    out = {}
    for n in batch_rows:
        optimizer = torch.optim.AdamW(params, lr=cfg.train.lr)
        rng = np.random.default_rng(0)
        model.train()
        timings = []
        for warm_up in (True, False):  # two batches to warm up, then one epoch measured
            batches = length_grouped_batches(merged.lengths(), n, rng)
            start = time.perf_counter()
            examples = 0
            for idx in batches[:2] if warm_up else batches:
                batch = {k: v.to(exp.device) for k, v in collate(merged, idx, exp.trainer.pad_id).items()}
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                examples += len(idx)
            if exp.device.type == "cuda":
                torch.cuda.synchronize()
            timings.append((time.perf_counter() - start, examples))
        seconds, examples = timings[-1]
        out[str(n)] = {"examples_per_s": examples / seconds, "seconds": seconds, "examples": examples}
    return out


def child(args: argparse.Namespace) -> None:
    scenario = args.scenario[0]
    if args.one == "limit":
        result = run_limit(scenario, args.device, [int(x) for x in args.batch_rows])
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        result = run_setting(scenario, args.one, args.device, Path(args.runs) / f"{scenario}-{args.one}-{stamp}")
    print("RESULT " + json.dumps(result), flush=True)


def in_child(scenario: str, one: str, args: argparse.Namespace, batch_rows: list[int] = ()) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--scenario", scenario, "--one", one,
           "--device", args.device, "--runs", args.runs, "--batch-rows", *map(str, batch_rows), "--set", *args.set]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{scenario} {one} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--per-pass", nargs="*", default=None, help="settings to run (default: each scenario's)")
    ap.add_argument("--no-flower", action="store_true", help="leave out Flower's simulation engine")
    ap.add_argument("--no-limit", action="store_true", help="leave out the one-model limit")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--runs", default="runs/clients_per_pass")
    ap.add_argument("--out", default=None, help="results JSON (merged into an existing file)")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides for every setting (KEY=VALUE)")
    ap.add_argument("--repeats", type=int, default=1, help="with more than 1: run the settings that many times, "
                    "interleaved (no limit; Flower if listed in --per-pass), and report each setting's round times "
                    "and its speed-up over one at a time in the same repeat")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--batch-rows", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    EXTRA.extend(args.set)
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(HERE))
    from results_io import save  # benchmarks/results_io.py

    results: dict[str, Any] = {}
    if args.out and Path(args.out).exists():
        results = {k: v for k, v in json.loads(Path(args.out).read_text()).items() if k != "machine"}
    for scenario in args.scenario:
        s = SCENARIOS[scenario]
        settings = args.per_pass or s["per_pass"]
        if args.repeats > 1:
            results[f"{scenario} ({args.device}) repeated"] = repeated(scenario, settings, args)
            if args.out:
                save(args.out, results)
            continue
        got = results.setdefault(f"{scenario} ({args.device})", {})
        for one in settings:
            got[one] = in_child(scenario, one, args)
            print(scenario, one, json.dumps(got[one]), flush=True)
        if not args.no_flower and args.device == "cpu":
            got["flower"] = in_child(scenario, "flower", args)
            print(scenario, "flower", json.dumps(got["flower"]), flush=True)
        passes = sorted({min(int(got[k].get("clients_per_pass") or 1), s["clients_per_round"])
                         for k in got if k not in ("flower", "limit")})
        if not args.no_limit:
            got["limit"] = in_child(scenario, "limit", args, [p * BATCH for p in passes])
            print(scenario, "limit", json.dumps(got["limit"]), flush=True)
        if args.out:
            save(args.out, results)
    print_tables(results)


def repeated(scenario: str, settings: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Every setting ``args.repeats`` times, interleaved (each repeat starts one setting later, so that a drift
    of the machine does not always fall on the same one): round times, the speed-up over one at a time in the
    same repeat, and the clients per pass in force."""
    settings = [one for one in settings if one != "limit"]
    out: dict[str, dict[str, list[Any]]] = {one: {"round_s": [], "vs_one": [], "clients_per_pass": [],
                                                  "peak_pss_mib": []} for one in settings}
    for i in range(args.repeats):
        order = settings[i % len(settings):] + settings[:i % len(settings)]
        this = {one: in_child(scenario, one, args) for one in order}
        for one, r in this.items():
            out[one]["round_s"].append(r["round_s"])
            out[one]["clients_per_pass"].append(r.get("clients_per_pass"))
            out[one]["peak_pss_mib"].append(r.get("peak_pss_mib"))
            if "1" in this:
                out[one]["vs_one"].append(this["1"]["round_s"] / r["round_s"])
        print(scenario, f"repeat {i + 1}", json.dumps({one: r["round_s"] for one, r in this.items()}), flush=True)
    return out


def print_repeated(scenario: str, got: dict[str, Any]) -> None:
    print(f"\n{scenario}\n")
    print("| setting | round s, median (min-max) | vs one at a time, mean ± sd (per repeat) | clients per pass | "
          "peak PSS MiB, median |")
    print("|---|---|---|---|---|")
    for one, r in got.items():
        times, ratios = r["round_s"], r["vs_one"]
        ratio = "-" if not ratios else (f"{statistics.mean(ratios):.2f}x ± {statistics.stdev(ratios):.2f} ("
                                        + ", ".join(f"{x:.2f}" for x in ratios) + ")")
        passes = sorted({p for p in r["clients_per_pass"] if p is not None})
        pss = [x for x in r.get("peak_pss_mib", []) if x]
        memory = f"{statistics.median(pss):.0f}" if pss else "-"
        print(f"| {one} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) | {ratio} | "
              f"{', '.join(map(str, passes)) or '-'} | {memory} |")


def print_tables(results: dict[str, Any]) -> None:
    for scenario, got in results.items():
        if scenario.endswith(" repeated"):
            print_repeated(scenario, got)
            continue
        base = got.get("1")
        limits = got.get("limit", {})
        best = max(limits, key=lambda n: limits[n]["examples_per_s"], default=None)
        limit = limits[best]["examples_per_s"] if best is not None else None
        print(f"\n{scenario}\n")
        of_best = f"of the best limit ({best} rows)" if best is not None else "of the best limit"
        print(f"| setting | round s | examples/s | vs one at a time | {of_best} | peak RSS MiB | peak PSS MiB | "
              "padded share (alone) |")
        print("|---|---|---|---|---|---|---|---|")
        for one, r in got.items():
            if one == "limit":
                continue
            per = int(r.get("clients_per_pass") or 1)
            speed = f"{r['examples_per_s'] / base['examples_per_s']:.2f}x" if base else "-"
            frac = f"{r['examples_per_s'] / limit:.0%}" if limit and one != "flower" else "-"
            pad = "-" if r.get("padded_share") is None else f"{r['padded_share']:.1%} ({r['alone_padded_share']:.1%})"
            gpu = f", GPU {r['peak_gpu_mib']:.0f}" if r.get("peak_gpu_mib") else ""
            if r.get("worker_gpu_mib"):
                gpu += f" (+ {r['worker_gpu_mib']:.0f} per worker)"
            pss = f"{r['peak_pss_mib']:.0f}" if r.get("peak_pss_mib") else "-"
            label = one if r.get("workers", 1) == 1 else f"{one} ({r['workers']} workers x {per})"
            print(f"| {label} | {r['round_s']:.2f} | {r['examples_per_s']:.1f} | {speed} | {frac} | "
                  f"{r['peak_rss_mib']:.0f}{gpu} | {pss} | {pad} |")
        for n, r in limits.items():
            print(f"| limit, batches of {n} | - | {r['examples_per_s']:.1f} | - | {r['examples_per_s'] / limit:.0%} | "
                  "- | - | - |")


if __name__ == "__main__":
    main()
