"""Local-training throughput (samples/s) of every PEFT method, through fedpeft's own local trainer.

    python benchmarks/throughput.py --out benchmarks/results/throughput.json

MiniLM-L6 on MNLI pairs (batch 16, max 128 tokens) for every method; SmolLM2-135M on E2E NLG
(causal LM, batch 8, max 96 tokens) for the methods that apply to a bias-free LLaMA decoder. Every
method sees the same batches; the first 2 steps are warm-up and not timed.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from results_io import print_table, save  # benchmarks/results_io.py

from fedpeft.config import load_config
from fedpeft.data.prepare import prepare_task
from fedpeft.models import registry
from fedpeft.training.local import LocalTrainer
from fedpeft.tuners import apply_tuner, method_options

SETUPS = {
    "minilm-l6": {
        "overrides": ["task.dataset=mnli", "task.train_split=train_subset", "task.eval_split=heldout_subset",
                   "task.max_length=128", "train.batch_size=16"],
        "kind": "classification",
        "methods": ["full", "lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning", "houlsby", "pfeiffer", "bitfit"],
    },
    "smollm2-135m": {
        "overrides": ["task.type=generation", "task.dataset=e2e_nlg", "task.train_split=validation_pairs",
                   "task.eval_split=test", "task.max_length=96", "train.batch_size=8"],
        "kind": "causal",
        "methods": ["full", "lora", "ia3", "prompt_tuning", "prefix_tuning", "houlsby", "pfeiffer"],
    },
}


def bench(model_name: str, setup: dict, steps: int, warmup: int) -> list[dict]:
    cfg = load_config(None, [f"model.name={model_name}", *setup["overrides"], "eval.max_examples=8",
                             f"task.max_train_examples={(steps + warmup) * 16}"])
    tok = registry.load_tokenizer(model_name)
    data = prepare_task(cfg.task, tok, encoder_decoder=False, seed=0, eval_max_examples=8)
    rows = []
    for method in setup["methods"]:
        model = registry.load_model(model_name, setup["kind"], num_labels=data.num_labels, tokenizer=tok)
        tuned = apply_tuner(model, method_options(method), setup["kind"])
        results = []
        for n_steps in (warmup, steps):
            train_cfg = cfg.train.model_copy(update={"local_steps": n_steps})
            trainer = LocalTrainer(train_cfg, device=torch.device("cpu"), pad_id=tok.pad_token_id, flops_sample_steps=0)
            results.append(trainer.train(tuned, data.train, np.random.default_rng(0)))
        timed = results[1]
        rows.append({"model": model_name, "method": method, "trainable": tuned.num_trainable(),
                     "steps": timed.steps, "samples": timed.examples, "seconds": timed.seconds,
                     "samples_per_s": timed.examples / timed.seconds, "tokens_per_s": timed.tokens / timed.seconds})
        print(rows[-1], flush=True)
        del tuned, model
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="minilm-l6,smollm2-135m")
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        rows += bench(name, SETUPS[name], args.steps, args.warmup)
    save(args.out, {"rows": rows})
    print_table(["model", "method", "trainable params", "samples/s", "tokens/s"],
                [[r["model"], r["method"], f"{r['trainable']:,}", f"{r['samples_per_s']:.1f}", f"{r['tokens_per_s']:.0f}"]
                 for r in rows])


if __name__ == "__main__":
    main()
