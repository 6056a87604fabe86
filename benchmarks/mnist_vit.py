"""Paper 004's vision half in miniature: a small ViT pretrained centrally on MNIST digits 0-4, then fine-tuned
federated on digits 5-9 (a new head, classes it never saw) with full fine-tuning vs Houlsby vs Pfeiffer adapters
vs LoRA under FedAvg, 10 clients, IID and Dirichlet(0.5) label skew, 3 seeds.

    python benchmarks/mnist_vit.py prepare            # the pretrained ViT and the digits-5-9 data
    python benchmarks/mnist_vit.py prepare --epochs 1 # quicker: one epoch of pretraining (--max-steps N: fewer)
    python benchmarks/mnist_vit.py run --seeds 0,1,2 --out benchmarks/results/mnist_vit.json

Data: the official MNIST test set (../shared/data/mnist/test.parquet, 10,000 images; the 60,000 training images
cannot be obtained here). Its 5,139 images of digits 0-4 pretrain the ViT; its 4,861 images of 5-9 are split once
(seed 0) into 3,861 for the clients and 1,000 for the server's evaluation, written as parquet in the Hub image
schema with labels 0-4 (label_text '5'..'9'). The ViT (28 px, patch 4: 49 patches and a class token, width 96,
4 layers of 4 heads, MLP 192, one channel) is trained from random weights for 6 epochs with AdamW; its encoder
(without the 0-4 head, as google/vit-base-patch16-224-in21k comes without one) and its image processor are saved as
a Hugging Face model directory, which the runs load by path like any Hub model, with a new head for 5-9.

Federated runs: configs/mnist_vit_adapters.yaml (10 rounds, all 10 clients, 1 local epoch, batch 32). Reported
per run: accuracy per evaluation round, bytes up and down per client and round (measured), local training time per
client and round (median) and the whole run's time; with several seeds, mean ± sample standard deviation.
Learning rates (the paper gives none for this scale): 5e-4 for full fine-tuning, 5e-3 for the adapters and LoRA.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import statistics
import time
from pathlib import Path

from results_io import (  # benchmarks/results_io.py
    load_config,
    over_seeds,
    parse_seeds,
    pm,
    print_table,
    save,
    train_or_reuse,
    welch_t,
)

from fedpeft.rundir import read_metrics

MNIST = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist" / "test.parquet"
WORK = Path("runs/mnist_vit")
PRETRAIN_DIGITS = range(5)
VIT = {"image_size": 28, "patch_size": 4, "num_channels": 1, "hidden_size": 96, "num_hidden_layers": 4,
       "num_attention_heads": 4, "intermediate_size": 192}
METHODS = {
    "full": ["peft={method: full}", "train.lr=0.0005"],
    "houlsby": ["peft={method: houlsby, reduction_factor: 8}", "train.lr=0.005"],
    "pfeiffer": ["peft={method: pfeiffer, reduction_factor: 8}", "train.lr=0.005"],
    "lora": ["peft={method: lora, r: 8, alpha: 16}", "train.lr=0.005"],
}
PARTITIONS = {"iid": ["federation.partition.scheme=iid"],
              "dirichlet0.5": ["federation.partition={scheme: dirichlet_label, alpha: 0.5}"]}


def prepare(work: Path, mnist: Path, epochs: int = 6, seed: int = 0, max_steps: int | None = None) -> None:
    """Write the pretrained ViT (``work``/vit-mnist-0to4) and the digits-5-9 dataset (``work``/mnist-5to9);
    ``epochs`` of pretraining, stopped after ``max_steps`` optimizer steps when given (a quicker, weaker ViT)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from PIL import Image
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

    table = pq.read_table(mnist)
    labels = np.asarray(table.column("label").to_pylist())
    images = table.column("image").to_pylist()
    rng = np.random.default_rng(seed)
    new = np.flatnonzero(labels >= len(PRETRAIN_DIGITS))
    rng.shuffle(new)
    data = work / "mnist-5to9"
    data.mkdir(parents=True, exist_ok=True)
    for split, idx in (("test", new[:1000]), ("train", new[1000:])):
        pq.write_table(pa.table({"image": [images[i] for i in sorted(idx)],
                                 "label": [int(labels[i]) - len(PRETRAIN_DIGITS) for i in sorted(idx)],
                                 "label_text": [str(labels[i]) for i in sorted(idx)]}), data / f"{split}.parquet")
    old = np.flatnonzero(labels < len(PRETRAIN_DIGITS))
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(images[i]["bytes"]))) for i in old])
    x = (torch.tensor(pixels, dtype=torch.float32)[:, None] / 255 - 0.5) / 0.5
    y = torch.tensor(labels[old])
    torch.manual_seed(seed)
    config = ViTConfig(**VIT, num_labels=len(PRETRAIN_DIGITS))
    model = ViTForImageClassification(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    steps = epochs * -(-len(x) // 64)
    if max_steps is not None:
        steps = min(steps, max_steps)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps)
    model.train()
    start = time.perf_counter()
    done = 0
    for epoch in range(epochs):
        if done == steps:
            break
        order = torch.randperm(len(x))
        correct = seen = 0
        for i in range(0, len(x), 64):
            if done == steps:
                break
            b = order[i:i + 64]
            out = model(pixel_values=x[b], labels=y[b])
            out.loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            correct += int((out.logits.argmax(-1) == y[b]).sum())
            seen += len(b)
            done += 1
        print(f"pretrain epoch {epoch + 1}/{epochs}: train accuracy {correct / seen:.4f} over {seen} images, "
              f"step {done}/{steps} ({time.perf_counter() - start:.0f} s)", flush=True)
    out_dir = work / "vit-mnist-0to4"
    model.vit.save_pretrained(out_dir)  # the encoder only, as google/vit-base-patch16-224-in21k: a new head learns 5-9
    ViTImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.5], image_std=[0.5]).save_pretrained(out_dir)
    digest = hashlib.sha256((out_dir / "model.safetensors").read_bytes()).hexdigest()
    print(f"wrote {out_dir} (model.safetensors SHA-256 {digest}) and {data} ({len(old)} pretraining images; "
          f"{len(new) - 1000} train / 1000 test)")


def run_one(config: str, sets: list[str], run_dir: Path, label: dict) -> dict:
    cfg = load_config(config, [*sets, "runtime.progress=false"])  # last too: after the --set in sets, as before
    start = time.perf_counter()
    wall = None if train_or_reuse(cfg, run_dir, str(label)) else time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [r for r in read_metrics(run_dir) if r["round"] > 0]
    per_client = [s for r in metrics for s in r["client_train_seconds"].values()]
    return {**label,
            "accuracy_by_round": {r["round"]: r["eval_accuracy"] for r in metrics if "eval_accuracy" in r},
            "initial_accuracy": summary["initial"], "final_accuracy": summary["final"],
            "trainable_parameters": summary["trainable_parameters"],
            "bytes_up_per_client_round": summary["mean_bytes_up_per_client_round"],
            "bytes_down_per_client_round": summary["mean_bytes_down_per_client_round"],
            "total_bytes": summary["total_bytes"],
            "local_train_s_per_client_round_median": statistics.median(per_client),
            "run_wall_s": wall, "run_dir": str(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=("prepare", "run"))
    ap.add_argument("--config", default="configs/mnist_vit_adapters.yaml")
    ap.add_argument("--work", default=str(WORK), help="where prepare writes the ViT and the data")
    ap.add_argument("--mnist", default=str(MNIST))
    ap.add_argument("--epochs", type=int, default=6, help="prepare: pretraining epochs (default 6)")
    ap.add_argument("--max-steps", type=int, help="prepare: stop pretraining after this many optimizer steps "
                    "(81 a full epoch); fewer give a quicker, weaker ViT")
    ap.add_argument("--runs", default="runs/mnist_vit/runs")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--partitions", default=",".join(PARTITIONS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="benchmarks/results/mnist_vit.json")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    if args.epochs < 1 or (args.max_steps is not None and args.max_steps < 1):
        ap.error("--epochs and --max-steps take a positive whole number")
    if args.step == "prepare":
        prepare(Path(args.work), Path(args.mnist), epochs=args.epochs, max_steps=args.max_steps)
        return
    seeds = parse_seeds(args.seeds) or [0]
    rows, table = [], []
    for part in args.partitions.split(","):
        full: list[dict] = []
        for method in args.methods.split(","):
            per_seed = []
            for seed in seeds:
                label = {"partition": part, "method": method, "seed": seed}
                row = run_one(args.config, [*PARTITIONS[part], *METHODS[method], f"seed={seed}", *args.set],
                              Path(args.runs) / part / method / f"seed{seed}", label)
                print(row, flush=True)
                per_seed.append(row)
            rows.extend(per_seed)
            full = per_seed if method == "full" else full
            table.append(table_row(part, method, per_seed, seeds, full))
    save(args.out, {"config": args.config, "methods": METHODS, "partitions": PARTITIONS, "seeds": seeds,
                    "vit": VIT, "sets": args.set, "rows": rows})
    print_table(["partition", "method", "trainable params", "KiB up / client / round", "less than full",
                 "accuracy by round (mean)", "final accuracy", "Welch's t vs full", "local train s / client / round"],
                table)


def table_row(part: str, method: str, per_seed: list[dict], seeds: list[int], full: list[dict]) -> list:
    """One line of the table: the method's means over the seeds, and its final accuracy against full fine-tuning's."""
    agg = over_seeds(per_seed, seeds)
    by_round = sorted(per_seed[0]["accuracy_by_round"], key=int)
    curve = " / ".join(f"{statistics.mean(r['accuracy_by_round'][k] for r in per_seed):.3f}" for k in by_round)
    full_up = statistics.mean(r["bytes_up_per_client_round"] for r in full) if full else None
    less = "-" if full_up is None or method == "full" else f"{1 - agg['bytes_up_per_client_round'] / full_up:.2%}"
    t = welch_t([r["final_accuracy"] for r in per_seed], [r["final_accuracy"] for r in full]) if full else "-"
    return [part, method, f"{int(agg['trainable_parameters']):,}", f"{agg['bytes_up_per_client_round'] / 1024:,.1f}", less,
            curve, pm(agg, "final_accuracy"), t if method != "full" else "-",
            pm(agg, "local_train_s_per_client_round_median", ".2f")]


if __name__ == "__main__":
    main()
