"""Embedded-runtime overhead: a federated round's wall time vs a bare PyTorch loop doing the same
local steps (same model, same clients' batches, same optimizer), measured alternately in one process.

    python benchmarks/overhead.py --rounds 9 --out benchmarks/results/overhead.json

The round time excludes server evaluation (reported separately by the runtime). FLOP sampling is off
in the main comparison (``runtime.flops_sample_steps=0``); the default (8 sampled steps per run, in
the first 4 rounds here) is measured as a second ratio. Round 1 (warm-up) is left out of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from results_io import save  # benchmarks/results_io.py
from torch.nn.utils.rnn import pad_sequence

from fedpeft.config import load_config
from fedpeft.runtime.embedded import EmbeddedRuntime
from fedpeft.training.local import plan_batches

BASE = [
    "name=overhead", "model.name=minilm-l6", "task.dataset=sst2", "task.max_train_examples=1600",
    "task.max_length=64", "federation.num_clients=10", "federation.clients_per_round=2",
    "train.batch_size=16", "train.lr=0.001", "eval.every=0", "eval.at_start=false", "eval.max_examples=32",
    "runtime.progress=false",
]


def bare_round(exp, clients: list[int], seed: int, rnd: int) -> float:
    """Plain PyTorch: pad each batch, forward, backward, clip, AdamW step, for every client's batches."""
    model = exp.tuned.module
    params = [p for p in model.parameters() if p.requires_grad]
    pad = exp.tokenizer.pad_token_id
    start = time.perf_counter()
    for cid in clients:
        data = exp.client_data(cid)
        epochs = plan_batches(data, exp.cfg.train, np.random.default_rng([seed, rnd, cid]))
        opt = torch.optim.AdamW(params, lr=exp.cfg.train.lr)
        model.train()
        for batches in epochs:
            for idx in batches:
                ids = [torch.as_tensor(data.input_ids[i], dtype=torch.long) for i in idx]
                input_ids = pad_sequence(ids, batch_first=True, padding_value=pad)
                mask = pad_sequence([torch.ones(len(x), dtype=torch.long) for x in ids], batch_first=True)
                tt = pad_sequence([torch.as_tensor(data.token_type_ids[i], dtype=torch.long) for i in idx], batch_first=True)
                labels = torch.as_tensor([data.labels[i] for i in idx])
                loss = model(input_ids=input_ids, attention_mask=mask, token_type_ids=tt, labels=labels).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(rounds: int, flops_steps: int, run_dir: Path) -> dict:
    cfg = load_config(None, [*BASE, f"federation.rounds={rounds}", f"runtime.flops_sample_steps={flops_steps}"])
    rt = EmbeddedRuntime(cfg, run_dir)
    wall_start = time.perf_counter()
    emb, bare, steps = [], [], []
    for rnd in range(1, rounds + 1):
        row = rt.run_round(rnd, wall_start)
        emb.append(row["time_round_s"] - row["time_evaluation_s"])
        bare.append(bare_round(rt.exp, row["clients"], cfg.seed, rnd))
        steps.append(sum(len(b) for c in row["clients"]
                         for b in plan_batches(rt.exp.client_data(c), cfg.train, np.random.default_rng([cfg.seed, rnd, c]))))
    # round 1 includes one-time warm-up (allocator, kernels): report it but rank on the rest
    ratios = [e / b for e, b in zip(emb[1:], bare[1:])]
    return {
        "flops_sample_steps": flops_steps,
        "embedded_round_s": emb, "bare_round_s": bare, "steps_per_round": steps,
        "median_embedded_s": statistics.median(emb[1:]), "median_bare_s": statistics.median(bare[1:]),
        "median_overhead_pct": 100 * (statistics.median(ratios) - 1),
        "mean_overhead_pct": 100 * (statistics.mean(ratios) - 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="benchmarks/results/overhead.json")
    args = ap.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "config": BASE,
            "no_flop_sampling": measure(args.rounds, 0, Path(tmp) / "a"),
            "flop_sampling_default_8": measure(args.rounds, 8, Path(tmp) / "b"),
        }
    save(args.out, results)
    for key in ("no_flop_sampling", "flop_sampling_default_8"):
        r = results[key]
        print(f"{key}: embedded {r['median_embedded_s']:.2f} s/round vs bare {r['median_bare_s']:.2f} s/round "
              f"({r['steps_per_round'][1]} steps) -> overhead median {r['median_overhead_pct']:+.1f}% "
              f"(mean {r['mean_overhead_pct']:+.1f}%)")


if __name__ == "__main__":
    main()
