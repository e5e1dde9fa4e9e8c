#!/usr/bin/env bash
# The GPU check sized for a short lease (~10 minutes on one H100/H200 instead of ~32):
# the correctness stages side by side (kernel tests spread over pytest-xdist workers),
# then the timed stages alone on the GPU, each stage capped at STAGE_LIMIT seconds.
#   bench/gpu/run_short.sh             -> bench/results/gpu_check_<device>.json
#   bench/gpu/run_short.sh --dry-run   -> the same on the CPU at tiny sizes
# serve needs Ray and Mooncake importable (bench/gpu/pack_deps.sh where nothing can be installed).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
W=${WORKDIR:-bench/results/gpu_check_work}
LIMIT=${STAGE_LIMIT:-200}
unset TRITON_INTERPRET
mkdir -p "$W"
rm -f "$W"/part_*.json
check() { "$PY" -m splitserve.cli bench gpu-check --workdir "$W" --stage-limit "$LIMIT" "$@"; }
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n ${KERNEL_WORKERS:-6}"
PYTEST_ADDOPTS="$XDIST" check --stages kernels --out "$W/part_1_kernels.json" "$@" &
check --stages fidelity --out "$W/part_2_fidelity.json" "$@" &
check --stages graphs --out "$W/part_3_graphs.json" "$@" &
case " $* " in *" --dry-run "*) ;; *)  # the engine stage's checkpoint, built on the CPU meanwhile
  "$PY" -c "from splitserve.benchmark.gpu_check_stages import engine_checkpoint as e; print(e())" & ;;
esac
wait
check --stages mbu_mfu,step_overhead,serve,features,engine --out "$W/part_4_timed.json" "$@"
exec "$PY" -m splitserve.benchmark.gpu_check --merge "$W"/part_*.json
