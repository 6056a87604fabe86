"""Paper 000 (assortment of attention heads) at this machine's scale.

Setting (configs/paper000_mnli_heads.yaml): MiniLM-L6 + LoRA r=16 on query/key/value, MNLI pairs
(train on the 8,999-pair ``train_subset`` split over 100 clients, 2 per round; evaluate on the disjoint
1,000-pair ``heldout_subset``, which is drawn from GLUE MNLI train, not the official dev sets), 90%
sparsity. Each experiment is one sub-command; runs are sequential (never two trainings at once) and a
finished run with the identical resolved config is reused, so experiments that share a run (the IID
method run appears in Table 1, Fig. 4 and Table 5) train it once.

    python benchmarks/paper000.py table1   # B1 / B2 / method x random / loss selection
    python benchmarks/paper000.py fig4     # method at sparsity 0, 50, 80, 90, 95%
    python benchmarks/paper000.py table5   # IID and Dirichlet 2.0 / 0.5 / 0.1: FedAvg (B1 + random) vs method
    python benchmarks/paper000.py fig5     # importance heat maps + client distance, IID vs Dirichlet 0.1
    python benchmarks/paper000.py table3   # PEFT methods under the method: max sparsity before chance
    python benchmarks/paper000.py selection --rounds 100 --eval-every 10 --runs runs/paper000_r100
                                           # random vs loss selection once Eq. 9 acts (all clients seen)
    python benchmarks/paper000.py table2 --tasks mnli,20news,e2e --scales 10/2,100/2,1000/20
                                           # FedAvg vs the method per task and federation scale, peak memory
    python benchmarks/paper000.py table4   # backbones: upload and OPs, dense vs the method, from configs
    python benchmarks/paper000.py ops      # every OPs figure the paper prints, against fedpeft.metrics.ops
    python benchmarks/paper000.py segments # Eq. 6 scores with and without the pairs' segment ids

Common options: ``--rounds`` (default 40), ``--eval-every`` (default 5), ``--set key=value`` (any config
override, applied to every run). Results go to benchmarks/results/paper000_<experiment>.json (table2:
paper000_table2_<tasks>.json, with ``--scale-rounds`` for rounds at one scale) and a markdown table is
printed; plots go next to them. Accounting per client and round: MiB up and down
(measured payload bytes), analytic OPs (Appendix A with the documented pruning reading in
fedpeft.metrics.ops) and measured FLOPs (torch.utils.flop_counter, which counts what is executed: masked
training executes the dense computation), local training seconds (without the importance pass) and the
importance pass's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from results_io import (  # benchmarks/results_io.py
    load_config,
    parse_seeds,
    pm,
    print_table,
    save,
    seeded_runs,
    train_or_reuse,
)

import fedpeft
from fedpeft.rundir import read_metrics, read_summary
from fedpeft.runtime.embedded import EmbeddedRuntime

CONFIG = "configs/paper000_mnli_heads.yaml"
B1 = ["algorithm.pruning=none", "algorithm.aggregation=fedavg"]
B2 = ["algorithm.pruning=random", "algorithm.aggregation=fedavg"]
METHOD = ["algorithm.pruning=importance", "algorithm.aggregation=importance"]
VARIANTS = {"B1": B1, "B2": B2, "method": METHOD}
SELECTIONS = {"random": ["algorithm.selection=random"], "loss": ["algorithm.selection=loss"]}
IMPORTANCE_ROUNDS = 10  # Fig. 5 records the selected clients' scores over the first rounds


def _giga(value: float | None) -> float | None:
    return None if value is None else value / 1e9


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


class ImportanceRecorder(fedpeft.RunObserver):
    """The clients' full Eq. 6 head importance scores of the first rounds (headprune reports them as
    "importance"; nothing of it travels on the wire)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_client_report(self, rnd: int, client_id: int, name: str, value: Any) -> None:
        if name == "importance" and rnd <= IMPORTANCE_ROUNDS:
            self.records.append({"round": rnd, "client": client_id, "alpha": [round(float(a), 6) for a in value]})


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.runs = Path(args.runs)
        self.common = [f"federation.rounds={args.rounds}", f"eval.every={args.eval_every}", *args.set]

    def run(self, key: str, overrides: list[str]) -> dict[str, Any] | None:
        """Train (or reuse) one run at every ``--seeds`` seed (each its own run directory, ``<key>-seed<s>``
        except seed 0); return its per-client-round accounting, every number averaged over the seeds (with
        ``<field>_std`` and ``<field>_seeds``; see results_io.over_seeds). The curve, the run directory and
        so the plots are seed 0's."""
        return seeded_runs(self.run_one, key, overrides, parse_seeds(self.args.seeds))

    def run_one(self, key: str, overrides: list[str]) -> dict[str, Any]:
        """Train (or reuse) one run; return its per-client-round accounting and curves."""
        cfg = load_config(self.args.config, [*self.common, *overrides, f"name=paper000-{key}"])
        run_dir = self.runs / key
        train_or_reuse(cfg, run_dir, key, train=train_recording_importance, note=" ".join(overrides))
        return self.describe(key, cfg, run_dir)

    def describe(self, key: str, cfg, run_dir: Path) -> dict[str, Any]:
        summary = read_summary(run_dir)
        rows = [r for r in read_metrics(run_dir) if r["round"] > 0]
        per_client = lambda field: [v for r in rows for v in (r.get(field) or {}).values() if v is not None]
        evals = [(r["round"], r["eval_accuracy"]) for r in read_metrics(run_dir) if "eval_accuracy" in r]
        return {
            "key": key,
            "run_dir": str(run_dir),
            "pruning": cfg.algorithm.pruning, "aggregation": cfg.algorithm.aggregation,
            "selection": cfg.algorithm.selection, "sparsity_configured": cfg.algorithm.sparsity,
            "peft": cfg.peft.method, "partition": cfg.federation.partition.model_dump(),
            "final_accuracy": summary["final"], "best_accuracy": summary["best"],
            "last3_accuracy": _mean([acc for _, acc in evals[-3:]]),
            "rounds_to_target": next((rnd for rnd, acc in evals if acc >= self.args.target), None),
            "target": self.args.target,
            "sparsity_measured": _mean([r.get("agg_sparsity_mean") for r in rows]) or 0.0,
            "mib_up_per_client_round": _mean(per_client("bytes_up")) / 2**20,
            "mib_down_per_client_round": _mean(per_client("bytes_down")) / 2**20,
            "ops_analytic_g_per_client_round": _giga(_mean(per_client("client_ops_analytic"))),
            "flops_measured_g_per_client_round": (_mean(per_client("client_flops")) or 0.0) / 1e9,
            "train_s_per_client_round_median": statistics.median(per_client("client_train_seconds")),
            "importance_s_per_client_round_mean": _mean([r.get("agg_importance_s_mean") for r in rows]),
            "eval_curve": evals,
            "wall_s": summary.get("wall_s") or (rows[-1]["wall_s"] if rows else None),
        }


def train_recording_importance(cfg, run_dir: Path) -> None:
    """Train one run in this process, with the clients' importance scores of the first rounds written to
    ``importance_first_rounds.json`` in its run directory (fig5 reads them)."""
    importance = ImportanceRecorder()
    rt = EmbeddedRuntime(cfg, run_dir, observers=[importance])
    rt.run()
    layout = rt.exp.layout
    (run_dir / "importance_first_rounds.json").write_text(json.dumps({
        "modules": layout.module_names if layout else [], "heads_per_module": layout.heads_per_module if layout else 0,
        "records": importance.records}))


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def table1(b: Bench) -> dict[str, Any]:
    rows = [b.run(f"{v}-{s}-s90", [*VARIANTS[v], *SELECTIONS[s], "algorithm.sparsity=0.9"])
            for v in ("B1", "B2", "method") for s in ("random", "loss")]
    print_table(["variant", "selection", "final acc", "mean of last 3 evals", "best acc", "rounds to target", "sparsity", "OPs (G) / client / round",
                 "measured FLOPs (G)", "MiB up / client / round", "MiB down", "train s / client / round (median)",
                 "importance s"],
                [[r["key"].split("-")[0], r["selection"], pm(r, "final_accuracy"), pm(r, "last3_accuracy"),
                  pm(r, "best_accuracy"),
                  pm(r, "rounds_to_target", ".0f").replace("-", "not reached"), f"{100 * r['sparsity_measured']:.0f}%",
                  _fmt(r["ops_analytic_g_per_client_round"], ".2f"), _fmt(r["flops_measured_g_per_client_round"], ".2f"),
                  _fmt(r["mib_up_per_client_round"], ".3f"), _fmt(r["mib_down_per_client_round"], ".3f"),
                  _fmt(r["train_s_per_client_round_median"], ".2f"), _fmt(r["importance_s_per_client_round_mean"], ".2f")]
                 for r in rows])
    from fedpeft.report.plots import plot_curves

    for path in plot_curves({r["key"]: read_metrics(r["run_dir"]) for r in rows}, "accuracy", Path(b.args.out_dir),
                            prefix="paper000_table1_"):
        print(f"plot: {path}")
    return {"rows": rows}


def fig4(b: Bench) -> dict[str, Any]:
    rows = [b.run(f"method-loss-s{round(100 * s)}", [*METHOD, *SELECTIONS["loss"], f"algorithm.sparsity={s}"])
            for s in (0.0, 0.5, 0.8, 0.9, 0.95)]
    dense = b.run("B1-loss-s90", [*B1, *SELECTIONS["loss"], "algorithm.sparsity=0.9"])
    print_table(["sparsity", "final acc", "mean of last 3 evals", "best acc", "MiB up / client / round", "OPs (G) / client / round",
                 "comm. vs B1", "OPs vs B1", "train s / client / round (median)", "importance s"],
                [[f"{100 * r['sparsity_configured']:.0f}%", pm(r, "final_accuracy"), pm(r, "last3_accuracy"),
                  pm(r, "best_accuracy"),
                  _fmt(r["mib_up_per_client_round"], ".3f"), _fmt(r["ops_analytic_g_per_client_round"], ".2f"),
                  f"{dense['mib_up_per_client_round'] / r['mib_up_per_client_round']:.2f}x",
                  f"{dense['ops_analytic_g_per_client_round'] / r['ops_analytic_g_per_client_round']:.2f}x",
                  _fmt(r["train_s_per_client_round_median"], ".2f"), _fmt(r["importance_s_per_client_round_mean"], ".2f")]
                 for r in rows])
    _plot_fig4(rows, dense, Path(b.args.out_dir) / "paper000_fig4.png")
    return {"rows": rows, "dense_B1_loss": dense}


def _plot_fig4(rows, dense, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = [100 * r["sparsity_configured"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, field, label in zip(axes, ("last3_accuracy", "mib_up_per_client_round", "ops_analytic_g_per_client_round"),
                                ("accuracy, mean of the last 3 evaluations", "MiB sent / client / round",
                                 "analytic OPs (G) / client / round")):
        ax.plot(s, [r[field] for r in rows], marker="o", label="method (loss selection)")
        ax.axhline(dense[field], color="gray", linestyle="--", label="B1 dense (loss selection)")
        ax.set_xlabel("sparsity (%)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


PARTITIONS = {part: [f"federation.partition={{scheme: {scheme}, alpha: {alpha}}}"] for part, scheme, alpha in
              (("iid", "iid", 0.5), ("dir2.0", "dirichlet_label", 2.0), ("dir0.5", "dirichlet_label", 0.5),
               ("dir0.1", "dirichlet_label", 0.1))}


def _partition_run(b: Bench, variant: str, selection: str, part: str) -> dict[str, Any]:
    key = f"{variant}-{selection}-s90" + ("" if part == "iid" else f"-{part}")
    return b.run(key, [*VARIANTS[variant], *SELECTIONS[selection], "algorithm.sparsity=0.9", *PARTITIONS[part]])


def table5(b: Bench) -> dict[str, Any]:
    out = []
    for part in PARTITIONS:
        fedavg = _partition_run(b, "B1", "random", part)
        method = _partition_run(b, "method", "loss", part)
        out.append({"partition": part, "fedavg": fedavg, "method": method})
    print_table(["partition", "FedAvg final acc", "FedAvg last 3", "FedAvg best", "FedAvg MiB up", "FedAvg OPs (G)",
                 "method final acc", "method last 3", "method best", "method MiB up", "method OPs (G)"],
                [[o["partition"], _fmt(o["fedavg"]["final_accuracy"]), _fmt(o["fedavg"]["last3_accuracy"]),
                  _fmt(o["fedavg"]["best_accuracy"]),
                  _fmt(o["fedavg"]["mib_up_per_client_round"], ".3f"), _fmt(o["fedavg"]["ops_analytic_g_per_client_round"], ".2f"),
                  _fmt(o["method"]["final_accuracy"]), _fmt(o["method"]["last3_accuracy"]), _fmt(o["method"]["best_accuracy"]),
                  _fmt(o["method"]["mib_up_per_client_round"], ".3f"), _fmt(o["method"]["ops_analytic_g_per_client_round"], ".2f")]
                 for o in out])
    return {"rows": out}


def fig5(b: Bench) -> dict[str, Any]:
    """Heat maps of the two selected clients' importance over the first rounds, and their distance."""
    series = {}
    for part in ("iid", "dir0.1"):
        run = _partition_run(b, "method", "loss", part)
        data = json.loads((Path(run["run_dir"]) / "importance_first_rounds.json").read_text())
        by_round: dict[int, list[dict[str, Any]]] = {}
        for rec in data["records"]:
            by_round.setdefault(rec["round"], []).append(rec)
        distances = []
        for rnd in sorted(by_round):
            recs = by_round[rnd]
            pairs = [(i, j) for i in range(len(recs)) for j in range(i + 1, len(recs))]
            d = [float(np.linalg.norm(np.subtract(recs[i]["alpha"], recs[j]["alpha"]))) for i, j in pairs]
            distances.append({"round": rnd, "clients": [r["client"] for r in recs], "distance": _mean(d)})
        series[part] = {"distances": distances, "records": data["records"], "modules": data["modules"],
                        "heads_per_module": data["heads_per_module"]}
    print_table(["round", "IID clients", "IID distance", "Dir(0.1) clients", "Dir(0.1) distance"],
                [[a["round"], a["clients"], _fmt(a["distance"]), c["clients"], _fmt(c["distance"])]
                 for a, c in zip(series["iid"]["distances"], series["dir0.1"]["distances"])])
    for part, s in series.items():
        ds = [d["distance"] for d in s["distances"] if d["distance"] is not None]
        print(f"{part}: distance mean {np.mean(ds):.4f}, std {np.std(ds):.4f}")
    _plot_fig5(series, Path(b.args.out_dir) / "paper000_fig5.png")
    return {"series": series}


def _plot_fig5(series, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 6))
    grid = fig.add_gridspec(2, 2, width_ratios=[3, 1.2])
    for row, (part, s) in enumerate(series.items()):
        ax = fig.add_subplot(grid[row, 0])
        recs = sorted(s["records"], key=lambda r: (r["round"], r["client"]))
        image = np.array([r["alpha"] for r in recs])
        im = ax.imshow(image, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(recs)), [f"r{r['round']} c{r['client']}" for r in recs], fontsize=5)
        hpm = s["heads_per_module"]
        ax.set_xticks([hpm * i + hpm / 2 - 0.5 for i in range(len(s["modules"]))], s["modules"], fontsize=7)
        for i in range(1, len(s["modules"])):
            ax.axvline(hpm * i - 0.5, color="white", linewidth=0.5)
        ax.set_title(f"{part}: importance (Eq. 6) of the selected clients, first rounds", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.02)
    ax = fig.add_subplot(grid[:, 1])
    for part, s in series.items():
        ax.plot([d["round"] for d in s["distances"]], [d["distance"] for d in s["distances"]], marker="o", label=part)
    ax.set_xlabel("round")
    ax.set_ylabel("Euclidean distance between the selected clients' scores")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


TABLE3_METHODS = {
    "lora_r16": [],  # the config's own LoRA r=16 (alpha 32): the same runs as Table 1 and Fig. 4
    "lora_r8": ["peft={method: lora, r: 8, alpha: 16}"],
    "lora_r4": ["peft={method: lora, r: 4, alpha: 8}"],
    "ia3": ["peft={method: ia3}", "train.lr=0.01"],
    "prompt_tuning": ["peft={method: prompt_tuning, num_virtual_tokens: 20}", "train.lr=0.03"],
    "p_tuning": ["peft={method: prefix_tuning, num_virtual_tokens: 20}", "train.lr=0.01"],
}


def _collapsed(b: Bench, run: dict[str, Any]) -> bool:
    return run["last3_accuracy"] < b.args.chance + b.args.margin


def table3(b: Bench) -> dict[str, Any]:
    """Per PEFT method: FedAvg (B1 + random selection) and the method (loss selection) on the sparsity grid
    0.5 / 0.8 / 0.9 / 0.95, searched from 0.9 (up to 0.95 if 0.9 holds, else down to 0.5 and then 0.8),
    which assumes accuracy does not rise with sparsity. Max sparsity = the largest tried that did not
    collapse, i.e. whose mean accuracy over the last three evaluations is at least chance + margin."""
    out = []
    for name, peft in TABLE3_METHODS.items():
        if name not in b.args.methods.split(","):
            continue
        suffix = "" if name == "lora_r16" else f"-{name}"
        dense = b.run(f"B1-random-s90{suffix}", [*B1, *SELECTIONS["random"], "algorithm.sparsity=0.9", *peft])
        tried: dict[float, dict[str, Any]] = {}

        def at(s: float) -> dict[str, Any]:
            tried[s] = b.run(f"method-loss-s{round(100 * s)}{suffix}",  # noqa: B023 (called within the iteration)
                             [*METHOD, *SELECTIONS["loss"], f"algorithm.sparsity={s}", *peft])  # noqa: B023 (called within the iteration)
            return tried[s]  # noqa: B023 (called within the iteration)

        if not _collapsed(b, at(0.9)):
            at(0.95)
        elif not _collapsed(b, at(0.5)):
            at(0.8)
        ok = [r for r in tried.values() if not _collapsed(b, r)]
        best = max(ok, key=lambda r: r["sparsity_configured"]) if ok else None
        out.append({"method": name, "fedavg": dense, "tried": [tried[k] for k in sorted(tried)],
                    "max_sparsity": best["sparsity_configured"] if best else None, "at_max": best})
    print(f"chance = {b.args.chance} (majority class of heldout_subset); collapse = mean of the last 3 evaluations "
          f"< chance + {b.args.margin}")
    print_table(["PEFT", "FedAvg train s / client / round", "FedAvg MiB up", "FedAvg OPs (G)", "FedAvg acc (last 3)",
                 "max sparsity", "method MiB up", "method OPs (G)", "method acc (last 3)", "last-3 accuracy per sparsity tried"],
                [[o["method"], _fmt(o["fedavg"]["train_s_per_client_round_median"], ".2f"),
                  _fmt(o["fedavg"]["mib_up_per_client_round"], ".4f"), _fmt(o["fedavg"]["ops_analytic_g_per_client_round"], ".2f"),
                  pm(o["fedavg"], "last3_accuracy"),
                  "none" if o["max_sparsity"] is None else f"{100 * o['max_sparsity']:.0f}%",
                  _fmt(o["at_max"] and o["at_max"]["mib_up_per_client_round"], ".4f"),
                  _fmt(o["at_max"] and o["at_max"]["ops_analytic_g_per_client_round"], ".2f"),
                  pm(o["at_max"], "last3_accuracy") if o["at_max"] else "-",
                  ", ".join(f"{100 * t['sparsity_configured']:.0f}%: {t['last3_accuracy']:.3f}" for t in o["tried"])]
                 for o in out])
    return {"chance": b.args.chance, "margin": b.args.margin, "rows": out}


def _selection_activity(run_dir: str) -> dict[str, Any]:
    """When did Eq. 9 choose by loss difference? Never-seen clients score +inf and rank first, so with
    100 clients and 2 per round the first rounds only enumerate unseen clients."""
    rows = [r for r in read_metrics(Path(run_dir)) if r["round"] > 0]
    finite = [r["round"] for r in rows if any(v not in ("inf", "-inf") for v in (r.get("selection_scores") or {}).values())]
    return {"distinct_clients": len({c for r in rows for c in r["clients"]}),
            "first_round_with_a_seen_client": finite[0] if finite else None,
            "rounds_choosing_by_loss": len(finite)}


def selection(b: Bench) -> dict[str, Any]:
    """Method (90%) with random vs loss-difference selection over enough rounds that Eq. 9 acts (> 50)."""
    rows = []
    for sel in ("random", "loss"):
        run = b.run(f"method-{sel}-s90", [*METHOD, *SELECTIONS[sel], "algorithm.sparsity=0.9"])
        run.update(_selection_activity(run["run_dir"]))
        acting = [acc for rnd, acc in run["eval_curve"] if rnd > 50]
        run["mean_acc_after_round_50"] = _mean(acting)
        rows.append(run)
    print_table(["selection", "final acc", "mean of last 3 evals", "mean acc of evals after round 50", "best acc",
                 "rounds to target", "distinct clients", "rounds choosing by loss (finite scores)"],
                [[r["selection"], pm(r, "final_accuracy"), pm(r, "last3_accuracy"), _fmt(r["mean_acc_after_round_50"]),
                  pm(r, "best_accuracy"), r["rounds_to_target"] or "not reached", r["distinct_clients"],
                  r["rounds_choosing_by_loss"] if r["selection"] == "loss" else "-"] for r in rows])
    from fedpeft.report.plots import plot_curves

    for path in plot_curves({r["key"]: read_metrics(r["run_dir"]) for r in rows}, "accuracy", Path(b.args.out_dir),
                            prefix=f"paper000_selection_r{b.args.rounds}_"):
        print(f"plot: {path}")
    return {"rows": rows}


# Table 2: FedAvg (B1, dense, random selection) vs the method (90% sparsity, loss selection) per task and scale.
# Every run is a fresh `fedpeft run` process, so its peak RSS (summary.json) is its own.
TABLE2_SCALES = {"10/2": (10, 2), "100/2": (100, 2), "1000/20": (1000, 20)}
TABLE2_VARIANTS = {"fedavg": [*B1, *SELECTIONS["random"]], "method": [*METHOD, *SELECTIONS["loss"], "algorithm.sparsity=0.9"]}
HEADPRUNE = "algorithm={name: headprune, importance_examples: 16}"
TABLE2_TASKS: dict[str, tuple[str, list[str], list[str]]] = {  # config, task overrides, primary metric(s)
    "mnli": (CONFIG, [], ["accuracy"]),
    # 20 Newsgroups with MiniLM-L6 (the paper: BART-base); a seeded 5,000 of the 11,314 training documents
    "20news": (CONFIG, ["task.dataset=20newsgroups", "task.train_split=train", "task.eval_split=test",
                        "task.max_train_examples=5000"], ["accuracy"]),
    # E2E NLG with SmolLM2-135M (the paper: T5-small); training pairs from the dev split, evaluation on the
    # test meaning representations (disjoint; configs/e2e_smollm2_lora.yaml), ROUGE-1/2/L. SmolLM2 trains ~3
    # pairs/s here, so E2E is sized down: 1,000 training pairs, 10 rounds, evaluation every 5 (100 test MRs).
    "e2e": ("configs/e2e_smollm2_lora.yaml", [HEADPRUNE, "peft={method: lora, r: 16, alpha: 32}",
                                              "task.max_train_examples=1000", "federation.rounds=10", "eval.every=5"],
            ["rouge1", "rouge2", "rougeL"]),
}


def _run_process(b: Bench, key: str, config: str, overrides: list[str]) -> Path:
    """Train (or reuse) one run in its own `fedpeft run` process."""
    sets = [*b.common, *overrides, f"name=paper000-{key}"]

    def train(cfg, run_dir: Path) -> None:
        flags = [x for o in sets for x in ("--set", o)]
        subprocess.run([sys.executable, "-m", "fedpeft.cli", "run", config, *flags, "--run-dir", str(run_dir),
                        "--no-progress"], check=True)

    run_dir = b.runs / key
    train_or_reuse(load_config(config, sets), run_dir, key, train=train, note=" ".join(overrides))
    return run_dir


def table2(b: Bench) -> dict[str, Any]:
    """Per task and scale: upload per client and round, analytic OPs, the metric and peak memory, FedAvg vs the
    method, with the metric against cumulative communication plotted per task and scale."""
    from fedpeft.report.plots import plot_curves

    rows = []
    # rounds for one scale, e.g. 10/2=20: at 10 clients each round trains 10x the data of 100/2
    scale_rounds = dict(x.split("=") for x in b.args.scale_rounds.split(",")) if b.args.scale_rounds else {}
    for task in b.args.tasks.split(","):
        config, task_overrides, metrics = TABLE2_TASKS[task]
        for scale in b.args.scales.split(","):
            n, k = TABLE2_SCALES[scale]
            curves = {}
            for variant, overrides in TABLE2_VARIANTS.items():
                key = f"table2-{task}-{n}x{k}-{variant}"
                rounds = [f"federation.rounds={scale_rounds[scale]}"] if scale in scale_rounds else []
                run_dir = _run_process(b, key, config, [*task_overrides, *rounds, f"federation.num_clients={n}",
                                                        f"federation.clients_per_round={k}", *overrides])
                summary = read_summary(run_dir)
                metric_rows = read_metrics(run_dir)
                curves[variant] = metric_rows
                trained = [r for r in metric_rows if r["round"] > 0]
                per_client = lambda field: [v for r in trained for v in (r.get(field) or {}).values() if v is not None]  # noqa: B023 (called within the iteration)
                final = summary.get("final_eval", {})
                primary = summary["primary_metric"]
                evals = [r[f"eval_{primary}"] for r in trained if f"eval_{primary}" in r]
                rows.append({"task": task, "scale": scale, "variant": variant, "run_dir": str(run_dir),
                             **{m: final.get(f"eval_{m}") for m in metrics},
                             "best": summary["best"], "primary_metric": primary,
                             "last3": _mean(evals[-3:]),  # evaluations after round 0 only
                             "mib_up_per_client_round": _mean(per_client("bytes_up")) / 2**20,
                             "mib_down_per_client_round": _mean(per_client("bytes_down")) / 2**20,
                             "ops_analytic_g_per_client_round": _giga(_mean(per_client("client_ops_analytic"))),
                             "peak_rss_mb": summary.get("peak_rss_mb"), "wall_s": summary.get("wall_s"),
                             "sparsity_measured": _mean([r.get("agg_sparsity_mean") for r in trained]) or 0.0})
                print(rows[-1], flush=True)
            for path in plot_curves(curves, metrics[-1], Path(b.args.out_dir),
                                    prefix=f"paper000_table2_{task}_{n}x{k}_"):
                print(f"plot: {path}")
    memory = []  # the check: the largest federation must not need much more memory than the smallest
    for task in b.args.tasks.split(","):
        for variant in TABLE2_VARIANTS:
            rss = {r["scale"]: r["peak_rss_mb"] for r in rows if r["task"] == task and r["variant"] == variant}
            if "10/2" in rss and "1000/20" in rss and rss["10/2"]:
                memory.append({"task": task, "variant": variant, "peak_rss_mb_10x2": rss["10/2"],
                               "peak_rss_mb_1000x20": rss["1000/20"], "ratio": rss["1000/20"] / rss["10/2"]})
    print_table(["task", "clients / per round", "variant", "metric (final)", "primary: best", "primary: mean of last 3",
                 "MiB up / client / round", "OPs (G) / client / round", "peak RSS (MiB)", "wall s"],
                [[r["task"], r["scale"], r["variant"],
                  " / ".join(_fmt(r[m]) for m in TABLE2_TASKS[r["task"]][2]), _fmt(r["best"]), _fmt(r["last3"]),
                  _fmt(r["mib_up_per_client_round"], ".3f"), _fmt(r["ops_analytic_g_per_client_round"], ".2f"),
                  _fmt(r["peak_rss_mb"], ".0f"), _fmt(r["wall_s"], ".0f")] for r in rows])
    if memory:
        print_table(["task", "variant", "peak RSS 10/2 (MiB)", "peak RSS 1000/20 (MiB)", "1000/20 vs 10/2"],
                    [[m["task"], m["variant"], f"{m['peak_rss_mb_10x2']:.0f}", f"{m['peak_rss_mb_1000x20']:.0f}",
                      f"{m['ratio']:.2f}x"] for m in memory])
    return {"rows": rows, "memory": memory}


# Table 4's backbones: architecture configs bundled with fedpeft (no weights; fedpeft.models.architectures) and
# the two with weights here. MNLI classification (3 labels) as in the paper, GPT-2 and SmolLM2 as causal LMs.
TABLE4_BACKBONES = {"T5-small": ("t5-small", "classification", (3.38, 1.86, 33.07, 8.47)),
                    "T5-base": ("t5-base", "classification", (10.13, 5.57, 128.19, 34.83)),
                    "BART-base": ("bart-base", "classification", (5.06, 2.78, 209.58, 59.01)),
                    "DistilBERT": ("distilbert", "classification", (6.22, 3.42, 42.73, 11.61)),
                    "RoBERTa-base": ("roberta-base", "classification", (7.89, 4.34, 21.89, 5.63)),
                    "GPT-2 small": ("gpt2", "causal", (3.94, 2.16, 42.73, 11.61)),
                    "MiniLM-L6 (weights here)": ("minilm-l6", "classification", None),
                    "SmolLM2-135M (weights here)": ("smollm2-135m", "causal", None)}

# Paper 000's Table 7 (L attention modules, H heads, d hidden), from which the paper computed its OPs; three rows
# differ from the published configs (DistilBERT has 6 modules, RoBERTa-base d 768, BART-base 18 modules, d 768).
TABLE7 = {"T5-small": (18, 8, 512), "T5-base": (36, 12, 768), "BART-base": (36, 16, 1024), "DistilBERT": (12, 12, 768),
          "RoBERTa-base": (12, 12, 512), "GPT-2 small": (12, 12, 768)}
# Every OPs figure the paper prints (G per training sequence of 512 tokens): (table, backbone, method, options,
# sparsity, printed)
PRINTED_OPS = [
    ("1-4", "T5-small", "lora", {"r": 16}, 0.0, 33.07), ("1-4", "T5-small", "lora", {"r": 16}, 0.9, 8.47),
    ("3", "T5-small", "full", {}, 0.0, 41.07), ("3", "T5-small", "full", {}, 0.9, 10.63),
    ("3", "T5-small", "lora", {"r": 8}, 0.0, 32.38), ("3", "T5-small", "lora", {"r": 8}, 0.9, 8.00),
    ("3", "T5-small", "lora", {"r": 4}, 0.0, 32.05), ("3", "T5-small", "lora", {"r": 4}, 0.9, 7.76),
    ("3", "T5-small", "ia3", {}, 0.0, 38.70), ("3", "T5-small", "ia3", {}, 0.5, 21.76),
    ("3", "T5-small", "prompt_tuning", {"num_virtual_tokens": 20}, 0.0, 22.81),
    ("3", "T5-small", "prompt_tuning", {"num_virtual_tokens": 20}, 0.9, 6.47),
    ("3 (P-Tuning)", "T5-small", "prefix_tuning", {"num_virtual_tokens": 20}, 0.0, 23.80),
    ("3 (P-Tuning)", "T5-small", "prefix_tuning", {"num_virtual_tokens": 20}, 0.9, 6.73),
    *((("4", bb, "lora", {"r": 16}, s, v) for bb, (_, _, p) in TABLE4_BACKBONES.items() if p and bb != "T5-small"
       for s, v in ((0.0, p[2]), (0.9, p[3])))),
    ("2 (20 Newsgroups)", "BART-base", "lora", {"r": 16}, 0.0, 228.90),
    ("2 (20 Newsgroups)", "BART-base", "lora", {"r": 16}, 0.9, 78.34),
]


def ops(b: Bench) -> dict[str, Any]:
    """Every OPs figure paper 000 prints against fedpeft.metrics.ops: the convention that reproduces them
    (paper000_macs) fed the paper's Table 7 L and d, the same on the published configs, and the Appendix-A
    transcription, at 512 tokens."""
    from fedpeft.metrics.ops import paper000_macs, sequence_ops
    from fedpeft.models.architectures import architecture_config
    from fedpeft.models.layout import model_shape

    rows = []
    for table, bb, method, options, s, printed in PRINTED_OPS:
        L7, H7, d7 = TABLE7[bb]
        shape = model_shape(architecture_config(TABLE4_BACKBONES[bb][0]))
        L, d = shape.num_attention_modules, shape.hidden
        table7 = paper000_macs(method, L7, d7, 512, options, 1.0 - s, heads=H7) / 1e9
        rows.append({"table": table, "backbone": bb, "method": method, "options": options, "sparsity": s,
                     "paper_g": printed, "table7_g": table7, "table7_error_pct": 100 * (table7 / printed - 1),
                     "config_g": paper000_macs(method, L, d, 512, options, 1.0 - s, heads=shape.num_heads) / 1e9,
                     "appendix_a_g": sequence_ops(method, L7, d7, 512, options, 1.0 - s) / 1e9})
    print_table(["table", "backbone", "method", "sparsity", "paper (G)", "ours, Table 7 L/d (G)", "error",
                 "ours, published config (G)", "Appendix A as printed, Table 7 L/d (G)"],
                [[r["table"], r["backbone"], r["method"] + (f" r{r['options']['r']}" if "r" in r["options"] else ""),
                  f"{100 * r['sparsity']:.0f}%", f"{r['paper_g']:.2f}", f"{r['table7_g']:.2f}",
                  f"{r['table7_error_pct']:+.2f}%", f"{r['config_g']:.2f}", f"{r['appendix_a_g']:,.0f}"] for r in rows])
    return {"tokens": 512, "rows": rows}


def segments(b: Bench) -> dict[str, Any]:
    """What the importance pass's segment ids change (issue 22): Eq. 6 scores of the initial model on the first
    ``--clients`` clients' shards (``importance_examples`` sampled pairs each, as a round-1 client draws them),
    with the pairs' token_type_ids (what training feeds) and without them (every token segment 0, as before
    the fix); the largest score change and how many of the 90% kept heads differ."""
    import dataclasses

    import torch

    from fedpeft.heads import head_importance, kept_by_importance
    from fedpeft.runtime.setup import build_experiment

    cfg = load_config(b.args.config, b.args.set)
    exp = build_experiment(cfg)
    res, layout = exp.client_resources, exp.layout
    rows = []
    for cid in range(b.args.clients):
        shard = exp.data.train.subset(exp.parts[cid])
        alphas = []
        for data in (shard, dataclasses.replace(shard, token_type_ids=None)):
            alphas.append(head_importance(exp.tuned, data, layout, pad_id=res["pad_id"],
                                          exclude_token_ids=res["exclude_token_ids"], device=torch.device("cpu"),
                                          max_examples=cfg.algorithm.importance_examples,
                                          rng=np.random.default_rng([cfg.seed, 1, cid, 0xA1FA])).alpha)
        kept = [set(kept_by_importance(a, cfg.algorithm.sparsity, layout).tolist()) for a in alphas]
        rows.append({"client": cid, "examples": len(shard), "max_abs_score_change": float(np.max(np.abs(alphas[0] - alphas[1]))),
                     "mean_abs_score_change": float(np.mean(np.abs(alphas[0] - alphas[1]))),
                     "kept_heads": len(kept[0]), "kept_heads_that_differ": len(kept[0] - kept[1])})
    print_table(["client", "pairs", "max |score change|", "mean |score change|", "kept heads", "of them not kept without segments"],
                [[r["client"], r["examples"], f"{r['max_abs_score_change']:.4f}", f"{r['mean_abs_score_change']:.4f}",
                  r["kept_heads"], r["kept_heads_that_differ"]] for r in rows])
    return {"rows": rows}


def table4(b: Bench) -> dict[str, Any]:
    """Table 4 from the architecture configs alone (fedpeft.footprint, what ``fedpeft model`` prints): LoRA
    r16 (alpha 32) on q/k/v, dense (FedAvg) and under the method at the config's sparsity, with the upload in the
    papers' convention (the LoRA tensors only, MiB, head-tied ones times 1 - s) and as a run's wire bytes (task
    head, kept-head ids, scores, metadata), and the OPs per sequence of ``--seq-len`` tokens in both conventions
    of fedpeft.metrics.ops. Nothing is trained: accuracy for the backbones with weights comes from table1 and
    table2 runs."""
    from fedpeft.footprint import footprint
    from fedpeft.models.architectures import architecture_config
    from fedpeft.tuners.tuned import method_options

    sparsity = load_config(b.args.config, b.args.set).algorithm.sparsity
    opts = method_options("lora", r=16, alpha=32)
    rows = []
    for name, (model, kind, printed) in TABLE4_BACKBONES.items():
        f = footprint(model, architecture_config(model), opts, kind, num_labels=3, sparsity=sparsity,
                      tokens=b.args.seq_len)
        rows.append({"backbone": name, "printed": printed, **f.as_dict()})
    print(f"sparsity {sparsity}, OPs per sequence of {b.args.seq_len} tokens")
    print_table(["backbone", "heads (kept)", "LoRA params", "paper MiB dense / method", "paper (MB)",
                 "run MiB dense / method", "run ratio", "GOPs paper000_macs dense / method", "paper (G)",
                 "GOPs appendix_a dense / method"],
                [[r["backbone"], f"{r['num_heads']} ({r['kept_heads']})", f"{r['peft_parameters']:,}",
                  f"{r['paper_mib']:.2f} / {r['paper_mib_pruned']:.2f}",
                  "-" if not r["printed"] else f"{r['printed'][0]} / {r['printed'][1]}",
                  f"{r['run_bytes'] / 2**20:.2f} / {r['run_bytes_pruned'] / 2**20:.2f}",
                  f"{r['run_bytes'] / r['run_bytes_pruned']:.2f}x",
                  f"{r['ops']['paper000_macs'] / 1e9:.2f} / {r['ops_pruned']['paper000_macs'] / 1e9:.2f}",
                  "-" if not r["printed"] else f"{r['printed'][2]} / {r['printed'][3]}",
                  f"{r['ops']['appendix_a'] / 1e9:,.0f} / {r['ops_pruned']['appendix_a'] / 1e9:,.0f}"] for r in rows])
    return {"sparsity": sparsity, "seq_len": b.args.seq_len, "rows": rows}


SEEDED = ("table1", "fig4", "table5", "table3")  # the experiments whose rows --seeds averages
EXPERIMENTS = {"table1": table1, "fig4": fig4, "table5": table5, "fig5": fig5, "table3": table3, "selection": selection,
               "table2": table2, "table4": table4, "ops": ops, "segments": segments}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--runs", default="runs/paper000")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.45, help="accuracy for 'rounds to target' (first evaluation at or above)")
    ap.add_argument("--methods", default=",".join(TABLE3_METHODS), help="table3: which PEFT methods")
    ap.add_argument("--chance", type=float, default=0.347,
                    help="table3: accuracy of always predicting the majority class (347 of the 1,000 heldout pairs)")
    ap.add_argument("--margin", type=float, default=0.02, help="table3: collapse = mean of the last 3 evaluations below chance + margin")
    ap.add_argument("--seq-len", type=int, default=512, help="table4: tokens per sequence for the analytic OPs "
                    "(the paper's 512)")
    ap.add_argument("--tasks", default="mnli,20news,e2e", help="table2: tasks")
    ap.add_argument("--scales", default="10/2,100/2,1000/20", help="table2: federation scales")
    ap.add_argument("--scale-rounds", default="", help="table2: rounds at some scales, e.g. 10/2=20 (both variants)")
    ap.add_argument("--clients", type=int, default=10, help="segments: clients whose shards are scored")
    ap.add_argument("--set", action="append", default=[], help="config override for every run")
    ap.add_argument("--seeds", default=None, help="run every row at these seeds (e.g. 0,1,2; the seed sets the partition, "
                    "the client selection and the initialisation) and report mean ± standard deviation")
    args = ap.parse_args(argv)
    if args.seeds and args.experiment not in SEEDED:
        raise SystemExit(f"--seeds applies to {', '.join(SEEDED)} (the others derive per-run figures from one seed)")
    b = Bench(args)
    # "all" = the paper's five; `selection` needs its own --rounds/--runs (see the module docstring)
    for name in [n for n in EXPERIMENTS if n not in ("selection", "table2", "table4", "ops", "segments")] if args.experiment == "all" else [args.experiment]:
        result = EXPERIMENTS[name](b)
        # table2 runs one task at a time here (hours each), so its results file is named by its tasks
        stem = f"paper000_table2_{args.tasks.replace(',', '_')}" if name == "table2" else f"paper000_{name}"
        save(Path(args.out_dir) / f"{stem}.json",
             {"command": "python benchmarks/paper000.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "config": args.config, "rounds": args.rounds, "eval_every": args.eval_every, "overrides": args.set,
              "seeds": parse_seeds(args.seeds),
              **({"scale_rounds": args.scale_rounds} if name == "table2" and args.scale_rounds else {}), **result})


if __name__ == "__main__":
    main()
