"""`splitserve simulate`: simulate a cluster on fitted costs, or plan its split.

  splitserve profile --out profile.json --serving          # once per machine/model
  splitserve simulate --profile profile.json --prefill-workers 2 --decode-workers 6 \\
      --rate 20 --num-requests 5000 --prompt-len 64:512 --long-fraction 0.2 --long-len 2048 \\
      --output-len 32:256 --slo-ttft 2000 --slo-tpot 100
  splitserve simulate --profile profile.json --plan --budget 16 --rate 20 ... \\
      --slo-ttft 2000 --slo-tpot 100                       # best prefill:decode split
  splitserve simulate --profile profile.json --trace bench.json ...   # replay a bench run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from splitserve.router.policy import PolicyConfig
from splitserve.simulator.costs import load_costs
from splitserve.simulator.planner import goodput_bound, make_evaluator, plan_split
from splitserve.simulator.report import summarize
from splitserve.simulator.routing import MODES
from splitserve.simulator.simulator import ClusterConfig, simulate
from splitserve.simulator.workload import ARRIVALS, RequestMix, build_trace, trace_from_bench


def _range(text: str) -> tuple[int, int]:
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH (integers), got {text!r}") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="splitserve simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, required=True, help="JSON written by `splitserve profile`")
    c = ap.add_argument_group("cluster")
    c.add_argument("--prefill-workers", type=int, default=1)
    c.add_argument("--decode-workers", type=int, default=1)
    c.add_argument("--routing-mode", choices=MODES, default="prefix")
    c.add_argument("--disagg-min-uncached-tokens", type=int, default=256)
    c.add_argument("--cache-blocks", type=int, default=16384, help="prefix-cache blocks per worker")
    c.add_argument("--cpu-cores", type=float,
                   help="workers share this many CPU cores (splitserve serve on one machine); "
                        "default: each worker has its own device")
    c.add_argument("--max-num-batched-tokens", type=int, help="default: the profile's")
    c.add_argument("--max-num-seqs", type=int, help="default: the profile's")
    m = ap.add_argument_group("request mix (or --trace)")
    m.add_argument("--trace", type=Path, help="replay a `splitserve bench --save-requests` result file")
    m.add_argument("--trace-prefix-len", type=int, default=0,
                   help="prefix-repetition traces: the shared prefix length in tokens")
    m.add_argument("--num-requests", type=int, default=1000)
    m.add_argument("--rate", type=float, default=1.0, help="requests per second")
    m.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    m.add_argument("--burstiness", type=float, default=1.0)
    m.add_argument("--prompt-len", type=_range, default=(128, 128))
    m.add_argument("--long-fraction", type=float, default=0.0)
    m.add_argument("--long-len", type=_range, default=(2048, 2048))
    m.add_argument("--output-len", type=_range, default=(64, 64))
    m.add_argument("--num-prefixes", type=int, default=0)
    m.add_argument("--prefix-len", type=int, default=0)
    m.add_argument("--prefix-fraction", type=float, default=1.0)
    m.add_argument("--seed", type=int, default=0)
    o = ap.add_argument_group("SLOs and planning")
    o.add_argument("--slo-ttft", type=float, help="ms")
    o.add_argument("--slo-tpot", type=float, help="ms")
    o.add_argument("--plan", action="store_true", help="find the split maximizing goodput per worker")
    o.add_argument("--budget", type=int, default=8, help="--plan: most workers in all")
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    ns = ap.parse_args(argv)
    try:
        costs = load_costs(ns.profile)
        costs = replace(costs, max_num_batched_tokens=ns.max_num_batched_tokens or costs.max_num_batched_tokens,
                        max_num_seqs=ns.max_num_seqs or costs.max_num_seqs)
        if ns.trace:
            trace = trace_from_bench(ns.trace, ns.trace_prefix_len)
        else:
            trace = build_trace(RequestMix(
                num_requests=ns.num_requests, rate=ns.rate, arrival=ns.arrival, burstiness=ns.burstiness,
                prompt_len=ns.prompt_len, long_fraction=ns.long_fraction, long_len=ns.long_len,
                output_len=ns.output_len, num_prefixes=ns.num_prefixes, prefix_len=ns.prefix_len,
                prefix_fraction=ns.prefix_fraction, seed=ns.seed))
        config = ClusterConfig(num_prefill=ns.prefill_workers, num_decode=ns.decode_workers,
                               routing_mode=ns.routing_mode, cache_blocks=ns.cache_blocks, seed=ns.seed,
                               cpu_cores=ns.cpu_cores,
                               policy=PolicyConfig(disagg_min_uncached_tokens=ns.disagg_min_uncached_tokens))
        config.validate()
    except (ValueError, OSError) as exc:
        print(f"splitserve simulate: {exc}", file=sys.stderr)
        return 2
    doc: dict = {"tool": "splitserve simulate", "profile": str(ns.profile), "requests": len(trace)}
    if ns.plan:
        if ns.slo_ttft is None and ns.slo_tpot is None:
            ap.error("--plan needs --slo-ttft and/or --slo-tpot")
        if ns.budget < 1:
            ap.error("--budget must be >= 1")
        start = time.perf_counter()
        plan = plan_split(make_evaluator(trace, costs, config, ns.slo_ttft, ns.slo_tpot), ns.budget,
                          goodput_bound(trace))
        b = plan.best
        print(f"{'prefill':>7} {'decode':>6} {'goodput/s':>10} {'per worker':>10} {'TTFT ms':>9} {'ITL ms':>7}")
        for row in plan.table():
            itl = row["mean_itl_ms"]
            print(f"{row['prefill']:>7} {row['decode']:>6} {row['goodput']:>10.3f} {row['goodput_per_worker']:>10.3f} "
                  f"{row['mean_ttft_ms']:>9.1f} {itl if itl is None else f'{itl:.1f}':>7}")
        print(f"best split: {b.num_prefill} prefill : {b.num_decode} decode, goodput {b.goodput:.3f} req/s "
              f"({b.goodput_per_worker:.3f} per worker); {len(plan.evaluated)} splits simulated in "
              f"{time.perf_counter() - start:.1f}s")
        doc.update(plan={"best": {"prefill": b.num_prefill, "decode": b.num_decode, "goodput": b.goodput,
                                  "goodput_per_worker": b.goodput_per_worker, "summary": b.summary.to_dict()},
                         "evaluated": plan.table(), "budget": ns.budget,
                         "slo_ttft_ms": ns.slo_ttft, "slo_tpot_ms": ns.slo_tpot})
    else:
        start = time.perf_counter()
        result = simulate(trace, costs, config)
        elapsed = time.perf_counter() - start
        summary = summarize(result, ns.slo_ttft, ns.slo_tpot)
        for key, value in summary.to_dict().items():
            print(f"{key:<24} {value if not isinstance(value, float) else f'{value:.3f}'}")
        print(f"simulated {len(trace)} requests on {config.num_prefill}+{config.num_decode} workers "
              f"({result.events} events) in {elapsed:.1f}s")
        doc.update(config=asdict(config), summary=summary.to_dict(), wall_s=elapsed, events=result.events)
    if ns.out:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
