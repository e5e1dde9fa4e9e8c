"""Simulator validation: predictions against real `splitserve serve` runs.

1. Calibrate: `splitserve profile --serving` on this machine (skipped when the
   profile exists, unless --reprofile).
2. For each configuration: run the real server under `splitserve bench`
   (--save-requests), then replay the very same requests (send times, prompt and
   output lengths) in `splitserve simulate --trace` with the same worker counts, and
   --cpu-cores set to this machine's cores (the workers share them; also reported
   without that term).
3. Compare mean TTFT and mean ITL; the target is within 25%.

    python -m bench.experiments.simulator_validation      # or: make bench-simulator
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from bench.experiments.harness import (
    RESULTS,
    cli,
    load_average,
    run_bench,
    serve,
    strip_requests,
    write_json,
)

PROFILE = RESULTS / "simulator_profile.json"
WORKLOAD = ["--workload", "random", "--input-len", "64:768", "--output-len", "16:64", "--ignore-eos",
            "--seed", "7", "--percentiles", "50,90,99"]
CONFIGS = {
    # name: (prefill workers, decode workers, requests, rate)
    "1 prefill + 1 decode": (1, 1, 80, 1.2),
    "2 decode (colocated)": (0, 2, 80, 1.2),
}


def simulate(trace_file: Path, prefill: int, decode: int, cpu_cores: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        command = cli("simulate", "--profile", str(PROFILE), "--trace", str(trace_file), "--prefill-workers",
                      str(prefill), "--decode-workers", str(decode), "--out", str(out))
        if cpu_cores:
            command += ["--cpu-cores", str(cpu_cores)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        return json.loads(out.read_text())["summary"]


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    width = 0.38
    for ax, key, title in ((axes[0], "mean_ttft_ms", "mean TTFT (ms)"), (axes[1], "mean_itl_ms", "mean ITL (ms)")):
        xs = range(len(rows))
        ax.bar([x - width / 2 for x in xs], [r["real"][key] for r in rows], width, label="real serve")
        ax.bar([x + width / 2 for x in xs], [r["simulated"][key] for r in rows], width, label="simulated")
        ax.set_xticks(list(xs), [r["config"] for r in rows])
        ax.set_title(title)
        for x, r in zip(xs, rows, strict=True):
            ax.annotate(f"{r['error'][key]:+.0%}", (x + width / 2, r["simulated"][key]), ha="center",
                        va="bottom")
        ax.legend(loc="lower right")
    fig.suptitle("splitserve simulate (calibrated here) against splitserve serve, same requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[experiment] wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reprofile", action="store_true", help="measure the profile again")
    ap.add_argument("--out", type=Path, default=RESULTS / "simulator_validation.json")
    ns = ap.parse_args(argv)
    if ns.reprofile or not PROFILE.exists():
        subprocess.run(cli("profile", "--serving", "--out", str(PROFILE)), check=True)
    rows = []
    for name, (prefill, decode, requests, rate) in CONFIGS.items():
        serve_args = ["--prefill-workers", str(prefill), "--decode-workers", str(decode), "--torch-threads", "1",
                      "--routing-seed", "0", "--log-level", "WARNING"]
        bench_args = [*WORKLOAD, "--num-prompts", str(requests), "--request-rate", str(rate)]
        before = load_average()
        with serve(serve_args) as server:
            run = run_bench(server, bench_args, name)
        after = load_average()
        # the replayed requests, kept so the comparison can be rerun from this file alone
        trace = [{k: r[k] for k in ("request_id", "success", "send_offset_s", "prompt_tokens", "output_tokens")}
                 for r in run["requests"]]
        with tempfile.TemporaryDirectory() as tmp:
            trace_file = Path(tmp) / "trace.json"
            trace_file.write_text(json.dumps({"runs": [{"requests": trace}]}))
            sim = simulate(trace_file, prefill, decode, os.cpu_count())
            no_sharing = simulate(trace_file, prefill, decode, None)
        real = {"mean_ttft_ms": run["ttft_ms"]["mean"], "mean_itl_ms": run["itl_ms"]["mean"],
                "p99_ttft_ms": run["ttft_ms"]["p99"], "p99_itl_ms": run["itl_ms"]["p99"],
                "request_throughput": run["request_throughput"]}
        simulated = {k: sim[k] for k in real}
        keys = ("mean_ttft_ms", "mean_itl_ms", "p99_ttft_ms", "p99_itl_ms")
        error = {k: simulated[k] / real[k] - 1 for k in keys}
        rows.append({"config": name, "real": real, "simulated": simulated, "error": error,
                     "simulated_without_cpu_sharing": {k: no_sharing[k] for k in real},
                     "error_without_cpu_sharing": {k: no_sharing[k] / real[k] - 1 for k in keys},
                     "trace": trace,
                     "within_25pct": all(abs(error[k]) <= 0.25 for k in ("mean_ttft_ms", "mean_itl_ms")),
                     "load_average_before": before, "load_average_after": after,
                     "commands": {"serve": "splitserve serve " + " ".join(serve_args), "bench": run["bench_command"],
                                  "simulate": f"splitserve simulate --profile {PROFILE.relative_to(RESULTS.parents[1])} "
                                              f"--trace BENCH_RESULT.json --prefill-workers {prefill} "
                                              f"--decode-workers {decode} --cpu-cores {os.cpu_count()}"},
                     "bench_run": strip_requests(run)})
        print(f"[experiment] {name}: mean TTFT real {real['mean_ttft_ms']:.1f} sim {simulated['mean_ttft_ms']:.1f} "
              f"({error['mean_ttft_ms']:+.1%}); mean ITL real {real['mean_itl_ms']:.2f} "
              f"sim {simulated['mean_itl_ms']:.2f} ({error['mean_itl_ms']:+.1%})", flush=True)
    profile = json.loads(PROFILE.read_text())
    write_json(ns.out, {"experiment": "simulator_validation", "created": datetime.now(UTC).isoformat(timespec="seconds"),
                        "machine": {"cpus": os.cpu_count(), "note": "shared machine; see load averages"},
                        "profile": str(PROFILE.relative_to(RESULTS.parents[1])), "costs": profile["costs"],
                        "target": "simulated mean TTFT and mean ITL within 25% of the real run",
                        "target_met": all(r["within_25pct"] for r in rows), "results": rows})
    plot(rows, ns.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
