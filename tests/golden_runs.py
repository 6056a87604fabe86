"""Short tiny-model runs of every built-in algorithm and PEFT method whose metrics.jsonl (every field but the
timings) is kept in tests/golden/, so that a change of the code's structure can be shown to change no result.

Record them again (only when a result is meant to change) with ``python tests/golden_runs.py --record``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden"
METHODS = ("full", "lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning", "houlsby", "pfeiffer", "bitfit")
LM = ["task.type=generation", "task.dataset=e2e_nlg", "task.train_split=validation_pairs", "task.eval_split=test",
      "eval.max_examples=8", "task.generation_max_new_tokens=8"]
CHOICE = ["task.type=multiple_choice", "task.dataset=arc_easy", "task.train_split=test[:80%]",
          "task.eval_split=test[80%:]", "task.max_train_examples=66", "task.max_length=64", "eval.max_examples=8"]
FEDSP = ["algorithm={name: fedsp, distill_steps: 4, server_steps: 2, distill_batch_size: 4}", "train.local_steps=2",
         "train.batch_size=4", "federation.num_clients=3", "peft={method: prefix_tuning, num_virtual_tokens: 4}"]

# name -> overrides of tests/helpers.tiny_config (tiny-bert, SST-2, 4 clients, 2 per round, 2 rounds)
GOLDEN: dict[str, list[str]] = {
    **{f"peft-{m}": [f"peft.method={m}"] for m in METHODS},
    "algorithm-fedavgm": ["algorithm={name: fedavgm, server_lr: 1.0, momentum: 0.9}"],
    "algorithm-fedadam": ["algorithm={name: fedadam, server_lr: 0.01}"],
    "algorithm-fedyogi": ["algorithm={name: fedyogi, server_lr: 0.01}"],
    "algorithm-fedprox": ["algorithm={name: fedprox, mu: 0.1}"],
    "algorithm-headprune": ["algorithm={name: headprune, sparsity: 0.5}"],
    "algorithm-headprune-ia3-random": ["algorithm={name: headprune, sparsity: 0.5, pruning: random, selection: random}",
                                       "peft.method=ia3"],
    "algorithm-fedpeptao": ["algorithm.name=fedpeptao", "peft={method: prefix_tuning, num_virtual_tokens: 4}",
                            "federation.rounds=3"],
    "algorithm-fedsp": ["model.name=tiny-llama", *CHOICE, *FEDSP],
    "algorithm-ffa_lora": ["algorithm.name=ffa_lora"],
    "algorithm-fedsa_lora": ["algorithm.name=fedsa_lora", "eval.personalized=true"],
    "algorithm-flora": ["algorithm.name=flora"],
    "algorithm-fedex_lora": ["algorithm.name=fedex_lora"],
    "algorithm-hetlora": ["algorithm={name: hetlora, rank_groups: [{rank: 4, share: 0.5}, {rank: 16, share: 0.5}]}"],
    "algorithm-flexlora": ["algorithm={name: flexlora, rank_groups: [{rank: 4, share: 0.5}, {rank: 16, share: 0.5}]}"],
    "causal-lora": ["model.name=tiny-gpt2", "peft.method=lora", *LM],
    "seq2seq-lora": ["model.name=tiny-t5", "peft.method=lora", *LM],
    "choice-prefix": ["model.name=tiny-llama", "peft={method: prefix_tuning, num_virtual_tokens: 4}", *CHOICE],
}


def golden_rows(name: str, run_dir: Path) -> list[dict[str, Any]]:
    """Run GOLDEN[name] into ``run_dir``; its metrics rows without the timing fields."""
    from helpers import tiny_config, without_timings

    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import EmbeddedRuntime

    EmbeddedRuntime(tiny_config(*GOLDEN[name]), run_dir).run()
    return [{k: v for k, v in row.items() if not is_timing(k)} for row in without_timings(read_metrics(run_dir))]


def is_timing(key: str) -> bool:
    """Seconds measured on the clock (e.g. FedSP's distill_seconds), which no two runs share; simulated seconds
    (sim_*) are the system's clock, the same in every run, and recorded."""
    return key.endswith(("_s", "_seconds")) and "sim_" not in key


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.jsonl"


def record(names: list[str]) -> None:
    import tempfile

    GOLDEN_DIR.mkdir(exist_ok=True)
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            rows = golden_rows(name, Path(tmp) / "run")
        golden_path(name).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        print(f"recorded {golden_path(name)} ({len(rows)} rows)")


if __name__ == "__main__":
    import os

    sys.path.insert(0, str(HERE))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import conftest  # noqa: F401  (the real data folder)

    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/golden_runs.py --record [NAME ...]")
    record(sys.argv[2:] or list(GOLDEN))
