"""Simulator speed: 1,000 workers and 1,000,000 requests (target: under 2 minutes here).

Costs are the calibrated profile of this machine (bench/results/simulator_profile.json);
the mix is a long/short prompt mix with shared prefixes, at a rate the cluster serves
without unbounded queues. Wall time is measured around `simulate()` alone and, for
the whole command, around `splitserve simulate` as a user runs it.

    python -m bench.experiments.simulator_speed      # or: make bench-simulator-speed
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.experiments.harness import RESULTS, cli, load_average, write_json

PROFILE = RESULTS / "simulator_profile.json"
MIX = {"--num-requests": "1000000", "--rate": "1000", "--prompt-len": "64:512", "--long-fraction": "0.2",
       "--long-len": "1024:2048", "--output-len": "16:128", "--num-prefixes": "2000", "--prefix-len": "256",
       "--prefix-fraction": "0.5", "--seed": "0"}
CLUSTER = {"--prefill-workers": "400", "--decode-workers": "600"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "simulator_speed.json")
    ns = ap.parse_args(argv)
    if not PROFILE.exists():
        print(f"{PROFILE} is missing: run `make bench-simulator` (or splitserve profile --serving --out {PROFILE})",
              file=sys.stderr)
        return 2
    sim_json = ns.out.with_name("simulator_speed_run.json")
    args = ["simulate", "--profile", str(PROFILE), *[x for kv in {**MIX, **CLUSTER}.items() for x in kv],
            "--slo-ttft", "2000", "--slo-tpot", "100", "--out", str(sim_json)]
    before = load_average()
    start = time.perf_counter()
    done = subprocess.run(cli(*args), capture_output=True, text=True)
    wall = time.perf_counter() - start
    print(done.stdout, done.stderr, flush=True)
    if done.returncode != 0:
        return done.returncode
    import json

    run = json.loads(sim_json.read_text())
    sim_json.unlink()
    write_json(ns.out, {"experiment": "simulator_speed", "created": datetime.now(UTC).isoformat(timespec="seconds"),
                        "command": "splitserve " + " ".join(args[:-2]).replace(str(PROFILE.parents[2]) + "/", ""),
                        "workers": 1000, "requests": run["requests"], "events": run["events"],
                        "simulate_wall_s": run["wall_s"], "command_wall_s": wall,
                        "target": "1,000 workers x 1,000,000 requests in under 120 s",
                        "target_met": wall < 120, "cpus": os.cpu_count(), "load_average_before": before,
                        "load_average_after": load_average(), "summary": run["summary"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
