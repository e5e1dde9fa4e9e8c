#!/usr/bin/env bash
# One call on a lent GPU machine (no package index there; see pack_deps.sh): unpack the carried
# wheels, probe what a batch-1 matmul reaches, run the short GPU check, and leave the results
# in $OUT (at most 8 files come back): the merged JSON, the probe's JSON, the kernel breakdown
# (diagnose.json, diagnose.log), all logs in one tarball.
#   bench/gpu/pack_deps.sh            # here, once: .gpucarry/site312.tar.xz (~48 MB)
#   device run, carry [".gpucarry"]:  bash bench/gpu/lease.sh
# Limits (60 + 450 + 75 s) keep the one call under the device's 600 s per command.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/lease_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tar xJf .gpucarry/site312.tar.xz -C /tmp || exit 1
export PYTHONPATH=/tmp/site312:$PWD LD_LIBRARY_PATH=/tmp/syslibs TIKTOKEN_ENCODINGS_BASE=/tmp/tiktoken  # o200k for openai-harmony
ldconfig -p | grep -q "libcurl.so.4 " || export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/tmp/syslibs/curl
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
timeout "${PROBE_LIMIT:-60}" python3 bench/gpu/gemv_probe.py "$OUT/gemv_probe.json"
touch /tmp/lease_marker
PYTHON=python3 STAGE_LIMIT=${STAGE_LIMIT:-120} WORKDIR=/tmp/gpu_check_work KERNEL_WORKERS=8 \
  timeout "${CHECK_LIMIT:-450}" bench/gpu/run_short.sh "$@" > "$OUT/run_short.log" 2>&1
echo "run_short exit $?"
for f in bench/results/gpu_check_*.json; do
  [ "$f" -nt /tmp/lease_marker ] || continue
  cp "$f" "$OUT/" && python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d.get("device"), d.get("started"), d.get("finished"))
for s in d["stages"]:
    print(f"{s['stage']:14} {s['status']:8} {s.get('seconds')}s  {str(s.get('reason'))[:230]}")
for t in d.get("summary", {}).get("targets", []):
    print(f"target: {t['name']}: {t['value']} ({t['target']}) met={t['met']}")
PY
done
# where the batch-1 decode step and the 2,048-token prefill spend their GPU time, kernel by kernel
# (the MBU / MFU targets' next step); after the check, so a slow start cannot cost its results
timeout "${DIAGNOSE_LIMIT:-75}" python3 bench/gpu/diagnose.py "$OUT" --parts prefill,kernel > "$OUT/diagnose.log" 2>&1
echo "diagnose exit $?"
tar czf "$OUT/gpu_check_work.tgz" -C /tmp gpu_check_work 2>/dev/null
ls -la "$OUT"
