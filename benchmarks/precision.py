"""Precision and memory savers of one client's training, measured on SmolLM2-135M, and what fits where.

    python benchmarks/precision.py --out benchmarks/results/precision.json

Part 1 (measured): instruction tuning (task.type instruction) of SmolLM2-135M with LoRA r8 on E2E NLG read as
instructions (configs/e2e_instruct_smollm2.yaml), fp32 vs bf16 (weights end to end) vs 8-bit (LLM.int8) vs
4-bit (NF4, double quantization) backbones, each with and without gradient checkpointing: the same short
training (2 rounds, one client each, ``--steps`` optimizer steps of 8 conversations per round, the same
seed, data and order), then eval loss, perplexity and ROUGE of greedy replies on 24 test MRs. Each variant
runs in its own process, one after another. Reported: the backbone's bytes as held (quantization constants
included), peak RSS of the process, the growth of RSS during the first round's training (its high-water
mark reset when training starts, Linux ``/proc/self/clear_refs``), seconds per optimizer step (the second
round: warm), quality, each as a ratio to fp32; on CUDA also peak allocated accelerator memory.

Part 2 (estimated): ``fedpeft.metrics.memory.estimate_training`` for the same setting, checked against the
measured figures (backbone bytes; training memory = the RSS growth on CPU, the accelerator's peak on CUDA),
then the backbone and one client's LoRA training memory of 1B, 3B, 7B and 8B shapes (architecture configs
on the meta device, no weights) in each precision, against 24, 48 and 80 GiB devices.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from results_io import print_table, save  # benchmarks/results_io.py

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "configs" / "e2e_instruct_smollm2.yaml"
PRECISIONS = {
    "fp32": ["model.dtype=float32"],
    "bf16": ["model.dtype=bfloat16"],
    "int8": ["model.quantization.bits=8"],
    "nf4": ["model.quantization.bits=4", "model.quantization.quant_type=nf4", "model.quantization.double_quant=true"],
}
ESTIMATE_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8", "nf4": "nf4"}
SHAPES = ["llama-3.2-1b", "opt-1.3b", "llama-3.2-3b", "open-llama-3b", "llama-7b", "llama-3.1-8b"]
DEVICES_GIB = [24, 48, 80]  # what "24 GB" / "48 GB" / "80 GB" accelerators hold
HEADROOM = 0.9  # a device "fits" a setting whose estimate is at most 90% of its memory (CUDA context, allocator)
MIB = 2**20


def settings(precision: str, checkpointing: bool, steps: int, nf4_compute: str) -> list[str]:
    sets = [
        "federation.num_clients=2", "federation.clients_per_round=1", "federation.rounds=2",
        f"train.local_steps={steps}", "train.batch_size=8", f"task.max_train_examples={2 * steps * 8}",
        "eval.at_start=false", "eval.every=0", "eval.max_examples=24", "eval.batch_size=8", "eval.save_best=false",
        "runtime.flops_sample_steps=0", "runtime.progress=false", f"train.gradient_checkpointing={str(checkpointing).lower()}",
        *PRECISIONS[precision],
    ]
    if precision == "nf4":
        sets.append(f"model.quantization.compute_dtype={nf4_compute}")
    return sets


# --- one variant, in its own process -------------------------------------------------------------------------

def _proc_status(field: str) -> float | None:
    """A memory field of /proc/self/status in MiB (None where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def run_variant(precision: str, checkpointing: bool, steps: int, nf4_compute: str, run_dir: Path) -> dict:
    import torch

    import fedpeft
    from fedpeft.config import apply_overrides

    probe: dict = {}

    class TrainingMemoryProbe(fedpeft.RunObserver):
        """RSS before the first round's training and its high-water mark over that round (no evaluation in it)."""

        def on_configure(self, rnd, payloads):
            if rnd != 1:
                return
            probe["rss_before_train_mb"] = _proc_status("VmRSS")
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM), Linux >= 4.0
                probe["hwm_reset"] = True
            except OSError:
                probe["hwm_reset"] = False
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                probe["cuda_before_train_mb"] = torch.cuda.memory_allocated() / MIB
                torch.cuda.reset_peak_memory_stats()

        def on_round_end(self, rnd, row):
            if rnd != 1:
                return
            probe["hwm_train_mb"] = _proc_status("VmHWM")
            if torch.cuda.is_available():
                probe["cuda_peak_train_mb"] = torch.cuda.max_memory_allocated() / MIB

    raw = yaml.safe_load(BASE_CONFIG.read_text())
    cfg = fedpeft.RunConfig.model_validate(apply_overrides(raw, settings(precision, checkpointing, steps, nf4_compute)))
    fedpeft.run(cfg, run_dir, observers=[TrainingMemoryProbe()])
    profiled = profiled_step(cfg, run_dir / "memory_timeline.json")
    summary = fedpeft.read_summary(run_dir)
    rows = [r for r in fedpeft.read_metrics(run_dir) if r["round"] >= 1]
    last = rows[-1]
    return {
        "precision": precision, "gradient_checkpointing": checkpointing,
        "backbone_bytes": summary["backbone_bytes"], "peak_rss_mb": summary["peak_rss_mb"],
        "peak_accelerator_mb": summary.get("peak_accelerator_mb"),
        "train_growth_mb": (probe["hwm_train_mb"] - probe["rss_before_train_mb"]) if probe.get("hwm_reset") else None,
        "cuda_train_growth_mb": (probe["cuda_peak_train_mb"] - probe["cuda_before_train_mb"])
        if "cuda_peak_train_mb" in probe else None,
        "s_per_step": last["time_client_s"] / steps, "s_per_step_round1": rows[0]["time_client_s"] / steps,
        "eval_loss": last.get("eval_loss"), "eval_perplexity": last.get("eval_perplexity"),
        "rougeL": last.get("eval_rougeL"), "train_loss": last.get("train_loss"), "device": summary.get("device"),
        "probe": probe, **profiled,
    }


def profiled_step(cfg, timeline: Path) -> dict:
    """The peak of tensor memory (PyTorch's memory profiler, its public timeline export) over one training step
    of the run's model at the shape the estimate is checked at: a batch of 8 sequences of the run's longest
    training sequence, forward, loss, backward and an AdamW step (after one unprofiled step, so that the
    optimizer's moments exist, as in training)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fedpeft.runtime.setup import build_experiment

    exp = build_experiment(cfg)
    longest = max(len(ids) for ids in exp.data.train.input_ids)
    model = exp.tuned.module
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(0, exp.tokenizer.vocab_size, (8, longest), generator=torch.Generator().manual_seed(0))
    ids = ids.to(exp.device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if exp.device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    prof.export_memory_timeline(str(timeline), device=str(exp.device if exp.device.index is not None
                                                            else f"{exp.device.type}:0" if exp.device.type == "cuda"
                                                            else "cpu"))
    _times, sizes = json.loads(timeline.read_text())
    timeline.unlink()
    return {"profiled_tokens": longest, "profiled_peak_mb": max(sum(row) for row in sizes) / MIB}


# --- the estimate ---------------------------------------------------------------------------------------------

def estimate(model: str, precision: str, *, checkpointing: bool, batch_size: int, tokens: int):
    from fedpeft.config import schema
    from fedpeft.metrics.memory import estimate_training
    from fedpeft.models.architectures import architecture_config

    raw = yaml.safe_load(BASE_CONFIG.read_text())
    peft = schema.RunConfig.model_validate({"peft": raw["peft"]}).peft
    return estimate_training(model, architecture_config(model), peft, "causal", precision, batch_size=batch_size,
                             tokens=tokens, gradient_checkpointing=checkpointing)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/precision.json")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per round (2 rounds)")
    ap.add_argument("--precisions", default="fp32,bf16,int8,nf4")
    ap.add_argument("--nf4-compute-dtype", default="float32", help="bfloat16 on GPUs (QLoRA)")
    ap.add_argument("--batch-size", type=int, default=4, help="batch of the what-fits table")
    ap.add_argument("--tokens", type=int, default=512, help="sequence length of the what-fits table")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one variant
        result = run_variant(args.one, bool(args.checkpointing), args.steps, args.nf4_compute_dtype, Path(args.run_dir))
        print("RESULT " + json.dumps(result))
        return

    # measured rows are kept in the results file as each variant finishes; a rerun with the same settings goes on
    # from there (delete the file to measure again)
    out_path = Path(args.out)
    previous = json.loads(out_path.read_text()) if out_path.exists() else {}
    same = previous.get("steps_per_round") == args.steps and previous.get("nf4_compute_dtype") == args.nf4_compute_dtype
    rows = [r for r in previous.get("rows", []) if same]
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            for ckpt in (0, 1):
                if any(r["precision"] == precision and r["gradient_checkpointing"] == bool(ckpt) for r in rows):
                    continue
                cmd = [sys.executable, __file__, "--one", precision, "--checkpointing", str(ckpt), "--steps",
                       str(args.steps), "--nf4-compute-dtype", args.nf4_compute_dtype,
                       "--run-dir", str(Path(tmp) / f"{precision}-{ckpt}")]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
                rows.append(json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:]))
                print({k: v for k, v in rows[-1].items() if k != "probe"}, flush=True)
                save(out_path, {"steps_per_round": args.steps, "nf4_compute_dtype": args.nf4_compute_dtype,
                                "rows": rows, "partial": True})
    base = {r["gradient_checkpointing"]: r for r in rows if r["precision"] == "fp32"}
    for r in rows:
        ref = base.get(False)
        if ref is None:
            continue
        for key in ("backbone_bytes", "peak_rss_mb", "train_growth_mb", "s_per_step", "eval_loss", "rougeL",
                    "peak_accelerator_mb"):
            if r.get(key) is not None and ref.get(key):
                r[f"{key}_ratio"] = r[key] / ref[key]

    # check of the estimate at the profiled shape (8 sequences of the longest training sequence)
    checks = []
    for r in rows:
        est = estimate("smollm2-135m", ESTIMATE_PRECISION[r["precision"]], checkpointing=r["gradient_checkpointing"],
                       batch_size=8, tokens=r["profiled_tokens"])
        # what the run's backbone_bytes holds: the backbone and the method's tensors (float32 in every precision)
        held = est.backbone_bytes + est.method_parameters * 4
        checks.append({"precision": r["precision"], "gradient_checkpointing": r["gradient_checkpointing"],
                       "backbone_estimate_bytes": held, "backbone_measured_bytes": r["backbone_bytes"],
                       "total_estimate_mb": est.total_bytes / MIB, "profiled_peak_mb": r["profiled_peak_mb"],
                       "peak_rss_mb": r["peak_rss_mb"], "estimate": est.as_dict()})

    fits = []
    for model in SHAPES:
        for precision in ("float32", "bfloat16", "int8", "nf4"):
            for ckpt in (False, True):
                est = estimate(model, precision, checkpointing=ckpt, batch_size=args.batch_size, tokens=args.tokens)
                fits.append(est.as_dict())

    save(args.out, {"base_config": str(BASE_CONFIG.relative_to(ROOT)),
                    "settings": {p: settings(p, False, args.steps, args.nf4_compute_dtype) for p in PRECISIONS},
                    "steps_per_round": args.steps, "nf4_compute_dtype": args.nf4_compute_dtype,
                    "rows": rows, "estimate_checks": checks,
                    "fits": {"batch_size": args.batch_size, "tokens": args.tokens, "headroom": HEADROOM, "rows": fits}})

    print_table(["precision", "checkpointing", "backbone MiB", "peak RSS MiB", "training growth MiB", "s/step",
                 "eval loss", "rougeL", "ratios to fp32 (backbone / RSS / growth / s/step / loss / rougeL)"],
                [[r["precision"], "on" if r["gradient_checkpointing"] else "off", f"{r['backbone_bytes'] / MIB:.1f}",
                  f"{r['peak_rss_mb']:.0f}", f"{r['train_growth_mb']:.0f}" if r["train_growth_mb"] is not None else "-",
                  f"{r['s_per_step']:.3f}", f"{r['eval_loss']:.4f}", f"{r['rougeL']:.4f}",
                  " / ".join(f"{r.get(k + '_ratio', float('nan')):.2f}" for k in
                             ("backbone_bytes", "peak_rss_mb", "train_growth_mb", "s_per_step", "eval_loss", "rougeL"))]
                 for r in rows])
    print()
    print_table(["precision", "checkpointing", "backbone + LoRA MiB: estimate / held", "one step MiB: estimate / profiled peak",
                 "estimate / profiled"],
                [[c["precision"], "on" if c["gradient_checkpointing"] else "off",
                  f"{c['backbone_estimate_bytes'] / MIB:.1f} / {c['backbone_measured_bytes'] / MIB:.1f}",
                  f"{c['total_estimate_mb']:.0f} / {c['profiled_peak_mb']:.0f}",
                  f"{c['total_estimate_mb'] / c['profiled_peak_mb']:.3f}"] for c in checks])
    print()
    print(f"fits: the estimate is at most {HEADROOM:.0%} of the device's memory; batch {args.batch_size} x "
          f"{args.tokens} tokens, LoRA r8 on q/v, AdamW; activations float32 except in bf16")
    header = ["model", "parameters", "precision", "backbone GiB", "training GiB (ckpt off / on)",
              *[f"{gib} GiB" for gib in DEVICES_GIB]]
    table = []
    for i in range(0, len(fits), 2):
        off, on = fits[i], fits[i + 1]
        cells = []
        for gib in DEVICES_GIB:
            cap = HEADROOM * gib * 2**30
            cells.append("yes" if off["total_bytes"] <= cap else "with ckpt" if on["total_bytes"] <= cap else "no")
        table.append([off["model"], f"{off['parameters'] / 1e9:.2f} B", off["precision"],
                      f"{off['backbone_bytes'] / 2**30:.2f}",
                      f"{off['total_bytes'] / 2**30:.1f} / {on['total_bytes'] / 2**30:.1f}", *cells])
    print_table(header, table)


if __name__ == "__main__":
    main()
