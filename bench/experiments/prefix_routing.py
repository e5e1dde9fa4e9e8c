"""Experiment (a): prefix-aware routing against round-robin and random.

Four decode workers (no prefill workers: every prompt is prefilled where it is
decoded, so the decode-worker choice alone decides cache reuse) serve the
prefix-repetition workload: N long shared prefixes x M short suffixes, shuffled,
Poisson arrivals. On this CPU the demo model prefills a 1024-token prompt in about
0.45 s and a 32-token suffix behind a cached prefix in a few ms, so TTFT is the
cost of cache misses plus queueing behind them. Each worker's KV pool holds about
half of the prefixes (--num-kv-blocks), as a real pool holds a fraction of the
shared contexts, so scattering a prefix over every worker also costs evictions.

    python -m bench.experiments.prefix_routing      # or: make bench-prefix-routing
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from bench.experiments.harness import (
    RESULTS,
    load_average,
    prefix_hit_rate,
    run_bench,
    serve,
    settle_metrics,
    strip_requests,
    write_json,
)

MODES = ("prefix", "round-robin", "random")


def serve_args(mode: str, ns: argparse.Namespace) -> list[str]:
    return ["--routing-mode", mode, "--routing-seed", "0", "--decode-workers", "4", "--prefill-workers", "0",
            "--torch-threads", "1", "--num-kv-blocks", str(ns.kv_blocks), "--log-level", "WARNING"]


def bench_args(ns: argparse.Namespace) -> list[str]:
    return ["--workload", "prefix-repetition", "--num-prefixes", str(ns.num_prefixes),
            "--suffixes-per-prefix", str(ns.suffixes), "--prefix-len", str(ns.prefix_len),
            "--input-len", str(ns.suffix_len), "--output-len", str(ns.output_len), "--ignore-eos",
            "--request-rate", str(ns.rate), "--seed", "0", "--percentiles", "50,90,99"]


def summarize(mode: str, run: dict, hits: dict, load_before: list[float], load_after: list[float]) -> dict:
    return {"mode": mode, "completed": run["completed"], "failed": run["failed"],
            "mean_ttft_ms": run["ttft_ms"]["mean"], "p99_ttft_ms": run["ttft_ms"]["p99"],
            "median_ttft_ms": run["ttft_ms"]["median"], "mean_itl_ms": run["itl_ms"]["mean"],
            "request_throughput": run["request_throughput"], "output_throughput": run["output_throughput"],
            "total_token_throughput": run["total_token_throughput"], "prefix_hit_rate": hits["hit_rate"],
            "load_average_before": load_before, "load_average_after": load_after}


def plot(rows: list[dict], runs: dict[str, dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    names = [r["mode"] for r in rows]
    ax1.bar(names, [r["mean_ttft_ms"] for r in rows], label="mean")
    ax1.bar(names, [r["p99_ttft_ms"] for r in rows], fill=False, edgecolor="black", label="p99")
    ax1.set_ylabel("TTFT (ms)")
    ax1.legend()
    ax1.set_title("TTFT")
    ax2.bar(names, [100 * (r["prefix_hit_rate"] or 0) for r in rows], color="tab:green")
    ax2.set_ylabel("prompt tokens from cache (%)")
    ax2.set_title("prefix-cache hit rate")
    for mode, run in runs.items():
        ttfts = sorted(r["ttft_ms"] for r in run["requests"] if r["success"])
        ax3.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=mode)
    ax3.set_xscale("log")
    ax3.set_xlabel("TTFT (ms)")
    ax3.set_title("TTFT CDF")
    ax3.legend()
    fig.suptitle("Prefix-aware vs round-robin vs random routing, 4 decode workers (demo model, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[experiment] wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prefixes", type=int, default=16)
    ap.add_argument("--suffixes", type=int, default=8, help="suffixes per prefix")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    ap.add_argument("--kv-blocks", type=int, default=512, help="KV blocks per decode worker (16 tokens each)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_routing.json")
    ns = ap.parse_args(argv)
    modes = [m for m in ns.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        ap.error(f"--modes takes a comma-separated subset of {', '.join(MODES)}")
    rows, runs, commands = [], {}, {}
    for mode in modes:
        before = load_average()
        with serve(serve_args(mode, ns)) as server:
            run = run_bench(server, bench_args(ns), f"routing={mode}")
            hits = prefix_hit_rate(settle_metrics(server))
        rows.append(summarize(mode, run, hits, before, load_average()))
        runs[mode] = run
        commands[mode] = {"serve": "splitserve serve " + " ".join(serve_args(mode, ns)),
                          "bench": run["bench_command"]}
    base = {r["mode"]: r for r in rows}
    ratios = {}
    if "prefix" in base:
        for other in ("round-robin", "random"):
            if other in base:
                ratios[f"mean_ttft_{other}_over_prefix"] = base[other]["mean_ttft_ms"] / base["prefix"]["mean_ttft_ms"]
                ratios[f"p99_ttft_{other}_over_prefix"] = base[other]["p99_ttft_ms"] / base["prefix"]["p99_ttft_ms"]
    document = {"experiment": "prefix_routing", "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": {"cpus": __import__("os").cpu_count(), "note": "shared machine; see load averages"},
                "parameters": vars(ns) | {"out": str(ns.out)}, "summary": rows, "ratios": ratios,
                "target": "prefix-aware mean TTFT at least 2x lower than round-robin",
                "target_met": ratios.get("mean_ttft_round-robin_over_prefix", 0) >= 2.0,
                "commands": commands, "runs": {m: strip_requests(r) for m, r in runs.items()}}
    write_json(ns.out, document)
    plot(rows, runs, ns.out.with_suffix(".png"))
    print(f"{'mode':<12} {'mean TTFT':>10} {'p99 TTFT':>10} {'req/s':>7} {'tok/s':>8} {'hit rate':>9}")
    for r in rows:
        print(f"{r['mode']:<12} {r['mean_ttft_ms']:>10.1f} {r['p99_ttft_ms']:>10.1f} {r['request_throughput']:>7.2f} "
              f"{r['total_token_throughput']:>8.0f} {100 * (r['prefix_hit_rate'] or 0):>8.1f}%")
    print(ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
