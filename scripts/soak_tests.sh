#!/usr/bin/env bash
# Run a set of test paths N times in a row with a CPU hog beside them (a busy loop on one
# core), as `make test` runs them (two xdist workers); stop at the first failing run.
# docs/testing.md: how tests/reliability and tests/chaos are shown not to flake.
#
#   scripts/soak_tests.sh [-n RUNS] [--no-hog] [PATHS...]   (default: 10 runs of tests/reliability tests/chaos)
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=10
HOG=1
while [ $# -gt 0 ]; do
  case "$1" in
    -n) RUNS=$2; shift 2 ;;
    --no-hog) HOG=0; shift ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || set -- tests/reliability tests/chaos
hog=""
if [ "$HOG" = 1 ]; then
  .venv/bin/python -c "while True: pass" &
  hog=$!
  trap 'kill $hog 2>/dev/null' EXIT
  echo "soak: CPU hog pid $hog (one core busy)"
fi
passed=0
for i in $(seq 1 "$RUNS"); do
  start=$SECONDS
  if .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --no-loadscope-reorder \
       -m "not full" "$@" > "/tmp/soak-run-$i.log" 2>&1; then
    passed=$((passed + 1))
    echo "soak: run $i passed in $((SECONDS - start)) s ($(tail -n 1 /tmp/soak-run-$i.log))"
  else
    echo "soak: run $i FAILED after $((SECONDS - start)) s; log: /tmp/soak-run-$i.log"
    grep -E "^(FAILED|ERROR)" "/tmp/soak-run-$i.log"
    echo "soak: $passed of $RUNS runs passed in a row before a failure"
    exit 1
  fi
done
echo "soak: $passed of $RUNS runs passed in a row"
