"""Experiment (b): disaggregated against colocated serving on a long/short prompt mix.

Same machine, same two engine processes in both configurations (2 cores, one torch
thread each):
- colocated: 2 decode workers, no prefill worker: every prompt is prefilled by the
  decode worker that streams it, inside its continuous batch;
- disaggregated: 1 prefill + 1 decode worker: prompts with at least
  --disagg-min-uncached-tokens uncached tokens (the long ones) are prefilled on the
  prefill worker and their KV pushed over gRPC; short ones stay local.

A long prompt's prefill chunk (up to --max-num-batched-tokens tokens) shares a step
with every running decode on a colocated worker, so each of those streams sees one
inter-token gap as long as that prefill: the tail of ITL. Disaggregation moves that
work to another process; the decode worker's steps stay short.

    python -m bench.experiments.disagg_vs_colocated      # or: make bench-disagg
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from bench.experiments.harness import (
    RESULTS,
    load_average,
    run_bench,
    serve,
    settle_metrics,
    strip_requests,
    write_json,
)

CONFIGS = {
    "colocated": ["--prefill-workers", "0", "--decode-workers", "2"],
    "disaggregated": ["--prefill-workers", "1", "--decode-workers", "1"],
}


def serve_args(name: str, ns: argparse.Namespace) -> list[str]:
    return [*CONFIGS[name], "--routing-seed", "0", "--torch-threads", "1", "--disagg-min-uncached-tokens",
            str(ns.disagg_threshold), "--max-num-batched-tokens", str(ns.max_num_batched_tokens),
            "--log-level", "WARNING"]


def bench_args(ns: argparse.Namespace) -> list[str]:
    return ["--workload", "long-context", "--num-prompts", str(ns.num_prompts), "--context-len", str(ns.long_len),
            "--input-len", str(ns.short_len), "--long-fraction", str(ns.long_fraction),
            "--output-len", str(ns.output_len), "--ignore-eos", "--request-rate", str(ns.rate), "--seed", "0",
            "--percentiles", "50,90,99,99.9"]


def by_length(run: dict, tag: str) -> dict:
    """Mean/p99 TTFT of the long or short requests alone (request ids end in -long/-short)."""
    ttfts = sorted(r["ttft_ms"] for r in run["requests"] if r["success"] and r["request_id"].endswith(tag))
    if not ttfts:
        return {"count": 0, "mean_ttft_ms": None, "p99_ttft_ms": None}
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    return {"count": len(ttfts), "mean_ttft_ms": sum(ttfts) / len(ttfts), "p99_ttft_ms": p99}


def summarize(name: str, run: dict, samples: dict, before: list[float], after: list[float]) -> dict:
    transfers = sum(s.get("splitserve_kv_transfer_bytes_total", 0.0) for s in samples.values())
    gaps = [g for r in run["requests"] if r["success"] for g in r["itl_ms"]]
    return {"config": name, "completed": run["completed"], "failed": run["failed"],
            "p99_itl_ms": run["itl_ms"]["p99"], "p99.9_itl_ms": run["itl_ms"]["p99.9"],
            "max_itl_ms": max(gaps), "gaps": len(gaps), "gaps_over_250ms": sum(g > 250 for g in gaps),
            "mean_itl_ms": run["itl_ms"]["mean"],
            "p90_itl_ms": run["itl_ms"]["p90"], "mean_ttft_ms": run["ttft_ms"]["mean"],
            "p99_ttft_ms": run["ttft_ms"]["p99"], "mean_tpot_ms": run["tpot_ms"]["mean"],
            "long": by_length(run, "-long"), "short": by_length(run, "-short"),
            "request_throughput": run["request_throughput"], "output_throughput": run["output_throughput"],
            "kv_transfer_bytes": transfers, "load_average_before": before, "load_average_after": after}


def plot(rows: list[dict], runs: dict[str, dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    names = [r["config"] for r in rows]
    ax1.bar(names, [r["p99_itl_ms"] for r in rows], fill=False, edgecolor="black", label="p99")
    ax1.bar(names, [r["mean_itl_ms"] for r in rows], label="mean")
    ax1.set_ylabel("ITL (ms)")
    ax1.set_title("inter-token latency")
    ax1.legend()
    ax2.bar(names, [r["p99_ttft_ms"] for r in rows], fill=False, edgecolor="black", label="p99")
    ax2.bar(names, [r["mean_ttft_ms"] for r in rows], label="mean")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_title("time to first token")
    ax2.legend()
    for name, run in runs.items():
        gaps = sorted(g for r in run["requests"] if r["success"] for g in r["itl_ms"])
        ax3.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=name)
    ax3.set_xscale("log")
    ax3.set_xlabel("inter-token gap (ms)")
    ax3.set_ylim(0.9, 1.0005)
    ax3.set_title("ITL CDF (top 10%)")
    ax3.legend()
    fig.suptitle("Disaggregated (1 prefill + 1 decode) vs colocated (2 decode) on a long/short mix (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[experiment] wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=120)
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--disagg-threshold", type=int, default=256, help="--disagg-min-uncached-tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="step token budget of every worker; a smaller one chunks long prefills")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=RESULTS / "disagg_vs_colocated.json")
    ns = ap.parse_args(argv)
    names = [c for c in ns.configs.split(",") if c]
    if any(c not in CONFIGS for c in names):
        ap.error(f"--configs takes a comma-separated subset of {', '.join(CONFIGS)}")
    rows, runs, commands = [], {}, {}
    for name in names:
        before = load_average()
        with serve(serve_args(name, ns)) as server:
            run = run_bench(server, bench_args(ns), name)
            samples = settle_metrics(server)
        rows.append(summarize(name, run, samples, before, load_average()))
        runs[name] = run
        commands[name] = {"serve": "splitserve serve " + " ".join(serve_args(name, ns)),
                          "bench": run["bench_command"]}
    rows_by = {r["config"]: r for r in rows}
    ratios = {}
    if len(rows_by) == 2:
        c, d = rows_by["colocated"], rows_by["disaggregated"]
        ratios = {"p99_itl_colocated_over_disaggregated": c["p99_itl_ms"] / d["p99_itl_ms"],
                  "mean_itl_colocated_over_disaggregated": c["mean_itl_ms"] / d["mean_itl_ms"],
                  "p99_ttft_colocated_over_disaggregated": c["p99_ttft_ms"] / d["p99_ttft_ms"],
                  "mean_ttft_colocated_over_disaggregated": c["mean_ttft_ms"] / d["mean_ttft_ms"]}
    document = {"experiment": "disagg_vs_colocated", "created": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": {"cpus": os.cpu_count(), "note": "shared machine; see load averages"},
                "parameters": vars(ns) | {"out": str(ns.out)}, "summary": rows, "ratios": ratios,
                "target": "disaggregated p99 ITL at least 1.5x lower than colocated",
                "target_met": ratios.get("p99_itl_colocated_over_disaggregated", 0) >= 1.5,
                "commands": commands, "runs": {n: strip_requests(r) for n, r in runs.items()}}
    write_json(ns.out, document)
    plot(rows, runs, ns.out.with_suffix(".png"))
    print(f"{'config':<14} {'p99 ITL':>8} {'p99.9 ITL':>9} {'mean ITL':>9} {'p99 TTFT':>9} {'mean TTFT':>10} "
          f"{'req/s':>6}")
    for r in rows:
        print(f"{r['config']:<14} {r['p99_itl_ms']:>8.1f} {r['p99.9_itl_ms']:>9.1f} {r['mean_itl_ms']:>9.1f} "
              f"{r['p99_ttft_ms']:>9.1f} "
              f"{r['mean_ttft_ms']:>10.1f} {r['request_throughput']:>6.2f}")
    print(ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
