"""What tracing costs per token: the same workload through `splitserve serve` (1 prefill + 1
decode worker) with tracing off and with every request traced (`--otlp-traces-endpoint` to
a real OTLP/gRPC receiver in this process, the tests' one: tests/helpers/otlp_receiver.py).

Runs alternate off, on, off, on... (`--repeats` pairs) so drift on a shared machine falls on
both; the medians are reported. Per run: output tok/s, TTFT and ITL p50, and CPU seconds per
generated token in the serve process (router) and in each worker outside its engine steps,
where the spans are made (splitserve bench serve-overhead's `served()`).

    python -m bench.experiments.tracing_overhead
"""

from __future__ import annotations

import argparse
import os
import statistics
from datetime import UTC, datetime

from bench.experiments.harness import RESULTS, load_average, write_json
from splitserve.benchmark.serve_overhead import served, workload
from splitserve.core.model_config import ModelConfig
from splitserve.engine.demo import ensure_demo_checkpoint
from tests.helpers.otlp_receiver import OTLPReceiver

SERVE = ["--prefill-workers", "1", "--decode-workers", "1", "--disagg-min-uncached-tokens", "32"]


def summary(run: dict) -> dict:
    cpu = run["cpu"]
    workers = [v["outside_steps_cpu_s_per_token"] for k, v in cpu.items() if k != "serve"]
    return {"output_tok_s": run["output_tok_s"], "ttft_p50_ms": run["ttft_ms"]["p50"],
            "itl_p50_ms": run["itl_ms"]["p50"], "failed": run["failed"],
            "router_cpu_us_per_token": cpu["serve"]["process_cpu_s_per_token"] * 1e6,
            "workers_outside_steps_cpu_us_per_token": sum(workers) * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    model = str(ensure_demo_checkpoint())
    vocab = ModelConfig.from_dir(model).vocab_size
    requests = workload(args.requests, (64, 128), (args.output_len, args.output_len), vocab, seed=0)
    warmup = workload(args.concurrency, (64, 128), (args.output_len, args.output_len), vocab, seed=1)
    # export every 0.2 s (the SDK's default: 5 s), so the spans of a run are exported, and their
    # CPU counted, inside the run's window rather than after it or never (serve is stopped at once)
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    receiver = OTLPReceiver()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                extra = ["--otlp-traces-endpoint", receiver.endpoint] if mode == "on" else []
                spans = len(receiver.spans)
                runs[mode].append(summary(served(model, requests, args.concurrency, SERVE + extra, warmup)))
                runs[mode][-1]["spans_received"] = len(receiver.spans) - spans
                print(mode, runs[mode][-1], flush=True)
    finally:
        receiver.stop()
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    doc = {"benchmark": "tracing_overhead", "created": datetime.now(UTC).isoformat(timespec="seconds"),
           "command": "python -m bench.experiments.tracing_overhead",
           "load_average": load_average(), "requests": args.requests, "concurrency": args.concurrency,
           "output_len": args.output_len, "spans_received": len(receiver.spans), "runs": runs, "median": medians}
    write_json(RESULTS / "tracing_overhead.json", doc)
    print(medians)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
