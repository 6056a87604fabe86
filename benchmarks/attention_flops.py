"""How much of the counted work the CPU's fused attention is: for each config of benchmarks/papers_time.py, one
round of two clients, counted once with fedpeft's counter (fedpeft.metrics.flops.flop_counter: attention counted
as the model's products whichever kernel runs it) and once with torch's own ``FlopCounterMode``, which counts the
CPU's fused kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, taken when there is no attention dropout)
as 0 FLOPs. The two runs train the same steps, so the gap is what runs recorded before fedpeft counted that kernel
left out of their counted FLOPs, and so of their simulated compute time. A backbone with attention dropout takes
the math kernel in training, which both count alike (a gap of 0).

    python benchmarks/mnist_vit.py prepare --max-steps 1 --work runs/attention_flops_vit   # the ViT's shape
    python benchmarks/attention_flops.py --vit-work runs/attention_flops_vit \\
        --out benchmarks/results/attention_flops.json

(The ViT's weights do not change its FLOPs: a ViT prepared with one pretraining step has the benchmark's shape.)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from mnist_vit import METHODS as VIT_METHODS  # benchmarks/mnist_vit.py
from paper000 import B1, METHOD  # benchmarks/paper000.py
from paper000 import CONFIG as PAPER000_CONFIG
from paper004 import METHODS as TEXT_METHODS  # benchmarks/paper004.py
from results_io import load_config, print_table, save  # benchmarks/results_io.py
from torch.utils.flop_counter import FlopCounterMode

import fedpeft.training.fused as fused_training
import fedpeft.training.local as local_training
from fedpeft.metrics.flops import flop_counter
from fedpeft.rundir import read_metrics
from fedpeft.runtime.embedded import EmbeddedRuntime

ONE_ROUND = ["federation.rounds=1", "federation.clients_per_round=2", "eval.every=0", "eval.max_examples=8",
             "train.local_steps=4", "runtime.flops_sample_steps=8", "runtime.progress=false"]


def torch_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False)


def counted_flops(config: str, overrides: list[str], run_dir: Path, counter) -> float:
    """The round's counted FLOPs (the clients' sum) with ``counter`` as the training loops' FLOP counter."""
    local_training.flop_counter, fused_training.flop_counter = counter, counter  # type: ignore[assignment]
    try:
        EmbeddedRuntime(load_config(config, [*overrides, *ONE_ROUND]), run_dir).run()
    finally:
        local_training.flop_counter, fused_training.flop_counter = flop_counter, flop_counter
    rows = [r for r in read_metrics(run_dir) if r.get("round") == 1 and r.get("flops")]
    if len(rows) != 1:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no round 1 with counted FLOPs; see its events.log")
    return float(rows[0]["flops"])


def experiments(vit_work: Path | None) -> list[tuple[str, str, str, list[str]]]:
    out = [("paper004 text", m, "configs/paper004_20news.yaml", o) for m, o in TEXT_METHODS.items()]
    if vit_work is not None:
        where = [f"model.name={vit_work / 'vit-mnist-0to4'}", f"task.dataset={vit_work / 'mnist-5to9'}"]
        out += [("paper004 vit", m, "configs/mnist_vit_adapters.yaml", [*o, *where]) for m, o in VIT_METHODS.items()]
    out += [("paper000", "fedavg (B1)", PAPER000_CONFIG, B1), ("paper000", "the method", PAPER000_CONFIG, METHOD)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vit-work", default=None, help="where `mnist_vit.py prepare` wrote the ViT and its data "
                    "(without it the ViT rows are left out)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (experiment, method, config, overrides) in enumerate(experiments(
                Path(args.vit_work) if args.vit_work else None)):
            with_attention = counted_flops(config, overrides, Path(tmp) / f"{i}-fedpeft", flop_counter)
            without = counted_flops(config, overrides, Path(tmp) / f"{i}-torch", torch_counter)
            rows.append({"experiment": experiment, "method": method, "config": config, "overrides": overrides,
                         "flops_counted": with_attention, "flops_without_cpu_attention": without,
                         "attention_share": 1 - without / with_attention})
            print(f"[{experiment} {method}] attention {rows[-1]['attention_share']:.2%} of the counted FLOPs",
                  flush=True)
    print_table(["experiment", "method", "GFLOPs counted (round)", "without the CPU's attention", "attention's share"],
                [[r["experiment"], r["method"], f"{r['flops_counted'] / 1e9:,.1f}",
                  f"{r['flops_without_cpu_attention'] / 1e9:,.1f}", f"{r['attention_share']:.2%}"] for r in rows])
    if args.out:
        save(args.out, {"round": ONE_ROUND, "rows": rows})


if __name__ == "__main__":
    main()
