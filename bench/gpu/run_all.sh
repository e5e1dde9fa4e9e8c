#!/usr/bin/env bash
# The GPU check of issue 20 in one command, on one H100/H200 (about 30 minutes):
#   bench/gpu/run_all.sh              -> bench/results/gpu_check_<device>.json
#   bench/gpu/run_all.sh --dry-run    -> bench/results/gpu_check_cpu_dry_run.json (any machine)
# Stages, their limits and expected times: splitserve/benchmark/gpu_check.py; docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
# The compiled kernels are the point: the interpreter must be off unless this is a dry run.
unset TRITON_INTERPRET
exec "$PY" -m splitserve.cli bench gpu-check "$@"
