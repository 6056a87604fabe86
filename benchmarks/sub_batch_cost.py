"""The fixed cost of a forward and backward on this device, in tokens: the basis of ``runtime.sub_batch_cost``'s
CPU default (``CPU_SUB_BATCH_COST`` in ``fedpeft/runtime/cohort.py``). The forward and backward of MiniLM-L6 +
LoRA r8 (the clients-per-pass benchmark's model) is timed at batches of several shapes, and a least-squares line
seconds = fixed + per_token x tokens goes through them; fixed / per_token is what a sub-batch of its own must
save in padding to pay for itself. (The plain model's pass: a fused pass adds its own bookkeeping per sub-batch,
the collation and each client's loss, so the fused figure is somewhat higher.)

    python benchmarks/sub_batch_cost.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from fedpeft.config import load_config
from fedpeft.runtime.setup import build_experiment

SHAPES = [(1, 16), (1, 32), (1, 64), (2, 32), (4, 32), (8, 32), (16, 32), (32, 32), (16, 64)]  # (rows, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm-l6")
    ap.add_argument("--repeats", type=int, default=7, help="timings per shape (the median is kept)")
    args = ap.parse_args()
    cfg = load_config(None, [f"model.name={args.model}", "task.dataset=mnli", "task.train_split=train_subset",
                             "task.eval_split=heldout_subset", "task.max_train_examples=64", "peft.method=lora",
                             "peft.r=8", "runtime.progress=false"])
    exp = build_experiment(cfg)
    model = exp.tuned.module.train()
    tokens, seconds = [], []
    print("rows  tokens  ms (median)")
    for rows, length in SHAPES:
        ids = torch.randint(1000, 2000, (rows, length))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(rows, dtype=torch.long)}
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            model(**batch).loss.backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        times = times[1:]
        tokens.append(rows * length)
        seconds.append(float(np.median(times)))
        print(f"{rows:4d}  {length:6d}  {1000 * seconds[-1]:.1f}")
    per_token, fixed = np.polyfit(tokens, seconds, 1)
    print(f"fit: {1000 * fixed:.1f} ms a sub-batch + {1000 * per_token:.3f} ms a token: one sub-batch costs "
          f"{fixed / per_token:.0f} tokens (torch {torch.__version__}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
