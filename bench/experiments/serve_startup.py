"""Seconds from `splitserve serve` to ready (issue 30's target: under 20 s), for the demo
model and a real one, the median of several starts; each start's phases from its own log.

    python -m bench.experiments.serve_startup [--model DIR ...] [--starts 3] [--out JSON]

Ready is the serving banner, which `serve` prints once every worker has registered with the
router (a request sent then is served).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from splitserve.core.banner import serving_url


def one_start(model: str | None, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "splitserve.cli", "serve", "--port", "0", *extra]
    if model:
        args += ["--model", model]
    start = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready = None
    try:
        for line in proc.stdout:
            if serving_url(line):
                ready = time.monotonic() - start
                break
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    if ready is None:
        raise RuntimeError("serve did not become ready")
    return {"ready": round(ready, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], help="checkpoint directories (the demo model always)")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = {"starts": args.starts, "models": []}
    for model in [None, *args.model]:
        runs = [one_start(model, []) for _ in range(args.starts)]
        median = statistics.median(r["ready"] for r in runs)
        name = Path(model).name if model else "demo"
        result["models"].append({"model": name, "median_ready_s": median, "runs": runs})
        print(f"{name}: ready in {median:.1f} s (median of {args.starts}: "
              f"{', '.join(str(r['ready']) for r in runs)})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
