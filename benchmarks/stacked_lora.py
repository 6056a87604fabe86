"""One LoRA-adapted projection, K clients: one client after another vs all clients in one fused pass.

    python benchmarks/stacked_lora.py --out benchmarks/results/stacked_lora.json

A kernel-level probe for issue 37 (clients trained together over the one frozen backbone), not a training
run: a frozen MiniLM-sized linear layer (384 -> 384) with LoRA r8, K clients each with a batch of ``rows`` x
``tokens`` inputs. Sequential: per client, the frozen projection on its rows plus its LoRA update, forward and
backward (what today's runtime does, layer by layer). Fused: the frozen projection once over all K x rows,
plus every client's update applied to its rows by :func:`fedpeft.tuners.stacked_lora.gathered_lora_delta`
(batched products over gathered factors) or :func:`~fedpeft.tuners.stacked_lora.grouped_lora_delta` (one
product per client). Reported: the median of ``--repeats`` timed repetitions (after warm-up) of forward +
backward, and the speed-up over sequential, per setting. One thread per setting is not forced: torch's
default threads, as a run uses them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedpeft.tuners.stacked_lora import gathered_lora_delta, grouped_lora_delta

HIDDEN, RANK, SCALING = 384, 8, 2.0
SETTINGS = [(32, 2, 32), (8, 4, 32), (16, 8, 32), (4, 16, 64)]  # (clients, rows per client, tokens)


def _time(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(clients: int, rows: int, tokens: int, repeats: int) -> dict[str, float | int]:
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
    a = (torch.randn(clients, RANK, HIDDEN, generator=gen) * 0.01).requires_grad_(True)
    b = (torch.randn(clients, HIDDEN, RANK, generator=gen) * 0.01).requires_grad_(True)
    x = torch.randn(clients * rows, tokens, HIDDEN, generator=gen)
    owner = torch.arange(clients).repeat_interleave(rows)

    def sequential() -> None:
        for k in range(clients):
            xs = x[k * rows:(k + 1) * rows]
            out = base(xs) + (xs @ a[k].T) @ b[k].T * SCALING
            out.square().mean().backward()

    def fused(delta) -> None:
        out = base(x) + delta(x, a, b, owner, SCALING)
        out.square().mean().backward()

    seq = _time(sequential, repeats)
    gathered = _time(lambda: fused(gathered_lora_delta), repeats)
    grouped = _time(lambda: fused(grouped_lora_delta), repeats)
    return {"clients": clients, "rows": rows, "tokens": tokens, "sequential_ms": seq * 1e3,
            "gathered_ms": gathered * 1e3, "grouped_ms": grouped * 1e3,
            "gathered_speedup": seq / gathered, "grouped_speedup": seq / grouped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    results = [measure(k, r, t, args.repeats) for k, r, t in SETTINGS]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| clients x rows x tokens | sequential ms | fused, gathered ms (speed-up) | fused, grouped ms (speed-up) |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['clients']} x {r['rows']} x {r['tokens']} | {r['sequential_ms']:.2f} | "
              f"{r['gathered_ms']:.2f} ({r['gathered_speedup']:.2f}x) | {r['grouped_ms']:.2f} ({r['grouped_speedup']:.2f}x) |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
