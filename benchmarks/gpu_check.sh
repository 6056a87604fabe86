#!/usr/bin/env bash
# On a machine with a CUDA GPU, in under 9 minutes (each step has its own time limit): the CUDA tests
# (tests/test_cuda.py), then the GPU part of benchmarks/clients_per_pass.py (cross-device MiniLM-L6 + LoRA r8: one
# client at a time, 8 and 32 per pass, auto, and the one-model limit), then worker processes (runtime.workers: auto,
# one per GPU, and 2 spawned workers of 32 clients per pass; on one GPU both share it); a short table last.
# Results: benchmarks/results/clients_per_pass_gpu.json.
#   bash benchmarks/gpu_check.sh            (PYTHON=... to use another interpreter than .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device here; run it on a machine with one" >&2
    exit 2
fi
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')"
mkdir -p runs
echo "== CUDA tests"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py > runs/gpu_check_tests.log 2>&1
tests=$?
tail -4 runs/gpu_check_tests.log
echo "== benchmark (GPU part)"
timeout 240 "$PY" benchmarks/clients_per_pass.py --device cuda --scenario cross-device --per-pass 1 8 32 auto \
    --no-flower --runs runs/gpu_check --out benchmarks/results/clients_per_pass_gpu.json > runs/gpu_check.log 2>&1
bench=$?
echo "== benchmark (workers on the GPUs)"
timeout 100 "$PY" benchmarks/clients_per_pass.py --device cuda --scenario cross-device --per-pass wautox32 w2x32 \
    --no-flower --no-limit --runs runs/gpu_check --out benchmarks/results/clients_per_pass_gpu.json > runs/gpu_check_workers.log 2>&1
workers=$?
grep -A 14 "^cross-device (cuda)" runs/gpu_check_workers.log || tail -20 runs/gpu_check_workers.log
echo "tests exit $tests, benchmark exit $bench, workers exit $workers"
