"""Paper 003 (FedSP) at this machine's scale: SmolLM2-135M (30 layers) is the server's private model.

Setting (configs/fedsp_arc_easy.yaml, the dataset swapped per run): 10 IID clients, all in every round
(the paper's 10 partitions), 40 prefix tokens (the paper's) initialised from a 40-token text
(``peft.init_text``), AdamW with weight decay 0.01 and a linear decay (the paper's; its 10% warm-up rounds
to no step at 3 local steps), lr 1e-2 for the prompts and 1e-4 for FedSP's auxiliary model, batch 8. The paper tunes
20-200 rounds of 10-20 local steps and distils for 5,000 steps on GPUs; on 2 CPU cores one training step of
SmolLM2-135M on 8 questions takes about 2 s, so here ``--rounds`` (default 5) rounds of ``--local-steps``
(default 3) steps per phase, ``--distill-steps`` (default 150, about 3 s each) distillation steps and ``--server-steps``
(default 2) steps of the server's prompt tuning per round. Each run is
evaluated once, after its last round, on a seeded subset of ``--eval-examples`` questions (default 200)
of the evaluation part, by the log-likelihood of each choice (accuracy and length-normalised accuracy).
The methods table also has the Table 4/5 columns: parameters a client loads and bytes per client and round.

    python benchmarks/paper003.py methods --datasets arc_easy,piqa    # Table 1/2 shape
    python benchmarks/paper003.py layers --datasets arc_easy          # Table 3 shape: bottom / middle / top
    python benchmarks/paper003.py depth --datasets piqa               # Fig. 2 shape: k = 1..4 blocks
    python benchmarks/paper003.py init --datasets arc_easy,piqa       # untrained: no prompts / random / text prefix

Only evaluation splits of most sets exist offline; train and evaluation parts are carved from one split,
disjoint and seeded (``task.split_shuffle_seed: 0``): see DATASETS. Methods:
  zero_shot         the global model without prompts (no training)
  finetune          centralized full fine-tuning (all training data in one place, lr ``--finetune-lr``)
  prefix_tuning     centralized prefix tuning (all training data in one place)
  fedprompt         FedAvg of prefix prompts, clients hold the global model (Zhao et al.)
  fedprompt_single  clients hold a 1-block model of the global one, no distillation, no sharing, prompts only
                    (the server tiles the 1-layer prompt to all layers; no server data or tuning, as FedPrompt)
  fedsp             FedSP: 1 bottom block shared across the 30 positions, distilled, alternating training,
                    server prompt tuning (``algorithm.server_steps``)
  fedsp_wo_kd / fedsp_wo_cs / fedsp_wo_at   without distillation / cross-layer sharing / alternation
The centralized methods train once for rounds x clients x local steps steps (one optimizer, one schedule),
as many prompt steps as all clients of the federated methods together take (each FedSP client takes
``--local-steps`` steps per phase, so its clients take as many auxiliary-model steps again). FedSP and its
ablations also spend ``--distill-steps`` and rounds x ``--server-steps`` steps on the server, whose shard
is 1/11 of the training part (the reference's one shard of 11; the clients share the other 10/11); the
other methods' clients share all of it.
"""

from __future__ import annotations

import argparse
import json
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

from fedpeft.config import dump_config
from fedpeft.rundir import read_metrics, read_summary

CONFIG = "configs/fedsp_arc_easy.yaml"
DATASETS = {  # train part, evaluation part (disjoint slices of one split where no train split exists here)
    "arc_easy": ["task.dataset=arc_easy", "task.train_split=test[:80%]", "task.eval_split=test[80%:]"],
    "arc_challenge": ["task.dataset=arc_challenge", "task.train_split=test[:80%]", "task.eval_split=test[80%:]"],
    "openbookqa": ["task.dataset=openbookqa", "task.train_split=test[:60%]", "task.eval_split=test[60%:]"],
    "piqa": ["task.dataset=piqa", "task.train_split=validation[:80%]", "task.eval_split=validation[80%:]"],
    "hellaswag": ["task.dataset=hellaswag", "task.train_split=validation[:50%]", "task.eval_split=validation[50%:]",
                  "task.max_train_examples=2000"],
    "race": ["task.dataset=race", "task.train_split=train", "task.eval_split=validation", "task.max_length=512",
             "task.max_train_examples=2000"],
}
FEDSP = ["algorithm.name=fedsp"]
FEDAVG = ["algorithm={name: fedavg}"]


def methods(a: argparse.Namespace) -> dict[str, list[str]]:
    central = ["federation.num_clients=1", "federation.clients_per_round=1", "federation.rounds=1",
               f"train.local_steps={a.rounds * a.clients * a.local_steps}"]
    return {
        "finetune": [*FEDAVG, *central, "peft={method: full}", f"train.lr={a.finetune_lr}"],
        "prefix_tuning": [*FEDAVG, *central],
        "fedprompt": [*FEDAVG],
        "fedprompt_single": [*FEDSP, "algorithm.share_layers=false", "algorithm.distill_steps=0",
                             "algorithm.client_training=prompts", "algorithm.server_steps=0",
                             "algorithm.server_data_fraction=0"],
        "fedsp": [*FEDSP],
        "fedsp_wo_kd": [*FEDSP, "algorithm.distill_steps=0"],
        "fedsp_wo_cs": [*FEDSP, "algorithm.share_layers=false"],
        "fedsp_wo_at": [*FEDSP, "algorithm.client_training=joint"],
    }


def layers(a: argparse.Namespace) -> dict[str, list[str]]:
    return {"fedsp" if p == "bottom" else f"fedsp_{p}": [*FEDSP, f"algorithm.aux_position={p}"]
            for p in ("bottom", "middle", "top")}


def depth(a: argparse.Namespace) -> dict[str, list[str]]:
    return {"fedsp" if k == 1 else f"fedsp_k{k}": [*FEDSP, f"algorithm.aux_layers={k}"] for k in (1, 2, 3, 4)}


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.runs = Path(a.runs)
        self.common = [f"federation.rounds={a.rounds}", f"federation.num_clients={a.clients}",
                       f"federation.clients_per_round={a.clients}", f"train.local_steps={a.local_steps}",
                       f"algorithm.distill_steps={a.distill_steps}", f"algorithm.server_steps={a.server_steps}",
                       f"eval.max_examples={a.eval_examples}", f"algorithm.client_trains={a.client_trains}",
                       "eval.every=0", "eval.at_start=false"]

    def config(self, dataset: str, key: str, overrides: list[str]):
        # the method's options come last: algorithm={name: fedavg} replaces the fedsp section and its options,
        # and --set algorithm.* (fedsp's options) applies to the fedsp runs only
        fedsp = not any(o.startswith("algorithm=") for o in overrides)
        sets = [o for o in self.a.set if fedsp or not o.startswith("algorithm.")]
        return load_config(self.a.config, [*DATASETS[dataset], *self.common, *overrides, *sets,
                                           f"name=paper003-{dataset}-{key}"])

    def run(self, dataset: str, key: str, overrides: list[str]) -> dict[str, Any] | None:
        """One row: the run at the config's seed, or at every ``--seeds`` seed (``<key>-seed<s>`` except seed 0),
        averaged."""
        return seeded_runs(lambda k, o: self.run_one(dataset, k, o), key, overrides, parse_seeds(self.a.seeds))

    def run_one(self, dataset: str, key: str, overrides: list[str]) -> dict[str, Any]:
        cfg = self.config(dataset, key, overrides)
        run_dir = self.runs / dataset / key
        train_or_reuse(cfg, run_dir, f"{dataset}/{key}", note=" ".join(overrides))
        return describe(dataset, key, run_dir)

    def zero_shot(self, dataset: str) -> dict[str, Any]:
        """The global model without prompts, on the same evaluation questions."""
        return self.untrained(dataset, "zero_shot", [*FEDAVG], prompts=False)

    def untrained(self, dataset: str, key: str, overrides: list[str], *, prompts: bool) -> dict[str, Any]:
        """Evaluate before any training: the bare global model, or with its initial prefix prompts."""
        out = self.runs / dataset / f"{key}.json"
        cfg = self.config(dataset, key, overrides)
        if out.exists() and json.loads(out.read_text()).get("config") == dump_config(cfg):
            print(f"[{dataset}/{key}] reusing {out}", flush=True)
            return json.loads(out.read_text())["row"]
        from fedpeft.runtime.setup import build_experiment
        from fedpeft.training.evaluate import evaluate

        exp = build_experiment(cfg)
        base = exp.tuned.module.get_base_model()
        res = evaluate(exp.tuned.module if prompts else base, exp.data, tokenizer=exp.tokenizer, device=exp.device,
                       batch_size=cfg.eval.batch_size, encoder_decoder=exp.encoder_decoder,
                       max_new_tokens=cfg.task.max_target_length, precision=cfg.runtime.precision)
        params = sum(p.numel() for p in base.parameters())
        row = {"dataset": dataset, "method": key, "accuracy": res["accuracy"],
               "accuracy_norm": res.get("accuracy_norm"), "client_model_parameters": params,
               "params_exchanged_per_client_round": 0, "global_parameters": params}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": dump_config(cfg), "row": row}, indent=2))
        return row


def describe(dataset: str, key: str, run_dir: Path) -> dict[str, Any]:
    summary = read_summary(run_dir)
    rows = read_metrics(run_dir)
    final = summary.get("final_eval", {})
    first = next((r for r in rows if r["round"] == 1), {})
    trained = [r for r in rows if r["round"] > 0]
    # what a client loads: the auxiliary model (FedSP) or the global model, plus the prompts
    prompts = summary["trainable_parameters"]
    aux = first.get("aux_parameters")
    glob = first.get("aux_global_parameters")
    if aux:  # without sharing a client holds the prompts of its k positions only
        prompts = prompts * first["aux_positions"] // first["aux_global_layers"]
    exchanged = [len(r.get("client_train_seconds", {})) for r in trained]
    up = [b for r in trained for b in r["bytes_up"].values() if b > 0]
    down_later = [b for r in trained if r["round"] > 1 for b in r["bytes_down"].values() if b > 0]
    return {
        "dataset": dataset, "method": key, "run_dir": str(run_dir),
        "accuracy": final.get("eval_accuracy"), "accuracy_norm": final.get("eval_accuracy_norm"),
        "trainable_parameters": summary["trainable_parameters"], "client_prompt_parameters": prompts,
        "aux_parameters": aux, "global_parameters": glob,
        "client_model_parameters": (aux + prompts) if aux else None,  # others: filled in from the zero-shot row
        "distill_loss_first": first.get("distill_loss_first"), "distill_loss_last": first.get("distill_loss_last"),
        "distill_seconds": first.get("distill_seconds"),
        "bytes_down_first_round": float(np.mean(list(first.get("bytes_down", {}).values()) or [0])),
        "mib_up_per_client_round": float(np.mean(up)) / 2**20 if up else None,
        "mib_down_per_client_round_after_first": float(np.mean(down_later)) / 2**20 if down_later else None,
        "client_seconds_per_round": float(np.mean([sum(r["client_train_seconds"].values()) for r in trained]))
        if trained else None,
        "clients_per_round": float(np.mean(exchanged)) if exchanged else None,
        "wall_s": summary.get("wall_s"),
    }


def _f(x: Any, spec: str = ".3f") -> str:
    return "/" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def report(rows: list[dict[str, Any]]) -> None:
    print_table(["dataset", "method", "accuracy", "acc_norm", "client model params", "MiB down / client, round 1",
                 "MiB up / client / round", "client s / round (all clients)", "wall s"],
                [[r["dataset"], r["method"], pm(r, "accuracy"), pm(r, "accuracy_norm"),
                  _f(r.get("client_model_parameters")), _f((r.get("bytes_down_first_round") or 0) / 2**20, ".2f"),
                  _f(r.get("mib_up_per_client_round"), ".4f"),
                  _f(r.get("client_seconds_per_round"), ".0f"), _f(r.get("wall_s"), ".0f")] for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=["methods", "layers", "depth", "init"])
    ap.add_argument("--datasets", default="arc_easy")
    ap.add_argument("--only", default=None, help="comma-separated subset of the experiment's methods")
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--runs", default=None, help="default runs/paper003 (--client-trains blocks: runs/paper003_blocks)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--local-steps", type=int, default=3)
    ap.add_argument("--distill-steps", type=int, default=150)
    ap.add_argument("--server-steps", type=int, default=2)
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--finetune-lr", type=float, default=1e-4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seeds", default=None, help="run every row at these seeds (e.g. 0,1,2) and report mean ± std")
    ap.add_argument("--client-trains", choices=["all", "blocks"], default="all",
                    help="FedSP: what a client updates of its auxiliary model: all (paper 003) or blocks (embeddings "
                    "and LM head frozen as distilled; the tables in BENCHMARKS.md of 2026-11-24 used blocks)")
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    a.runs = a.runs or ("runs/paper003" if a.client_trains == "all" else "runs/paper003_blocks")
    print(f"FedSP clients train: {a.client_trains} of the auxiliary model (runs in {a.runs})", flush=True)
    bench = Bench(a)
    only = set(a.only.split(",")) if a.only else None
    rows = []
    for dataset in a.datasets.split(","):
        if a.experiment in ("methods", "init") and (only is None or "zero_shot" in only):
            rows.append(bench.zero_shot(dataset))
        if a.experiment == "init":  # the prefix prompts every prefix method starts from, before training
            rows.append(bench.untrained(dataset, "prefix_init_text", [*FEDAVG], prompts=True))
            rows.append(bench.untrained(dataset, "prefix_init_random", [*FEDAVG, "peft.init_text=null"], prompts=True))
            continue
        plan = {"methods": methods, "layers": layers, "depth": depth}[a.experiment](a)
        for key, overrides in plan.items():
            if only is None or key in only:
                rows.append(bench.run(dataset, key, overrides))
                print(rows[-1], flush=True)
    global_params = next((r["global_parameters"] for r in rows if r.get("global_parameters")), None)
    for r in rows:  # without an auxiliary model a client loads the global model (the prompts are in it or extra)
        if r.get("client_model_parameters") is None and global_params:
            extra = 0 if r["method"] == "finetune" else r["trainable_parameters"]
            r["client_model_parameters"] = global_params + extra
    out = a.out or f"benchmarks/results/paper003_{a.experiment}_{a.datasets.replace(',', '_')}.json"
    save(out, {"experiment": a.experiment, "config": a.config, "rounds": a.rounds, "local_steps": a.local_steps,
               "distill_steps": a.distill_steps, "eval_examples": a.eval_examples, "client_trains": a.client_trains,
               "seeds": parse_seeds(a.seeds), "rows": rows})
    report(rows)


if __name__ == "__main__":
    main()
