#!/usr/bin/env bash
# Runs every benchmark one after another (never two trainings at once) and keeps their logs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
mkdir -p benchmarks/results
for b in throughput overhead memory paper004; do
  echo "== $b"
  $PY benchmarks/$b.py 2>&1 | grep -v -i -E "warn|Loading weights" | tee benchmarks/results/$b.log
done
