"""`splitserve bench compare`: the same workload against two or more OpenAI-compatible
servers, interleaved, several rounds; medians and ratios to the first server.

  splitserve bench compare --server splitserve,http://127.0.0.1:8000,demo \\
      --server vllm,http://127.0.0.1:8001,demo --concurrency 1,8,32 --rounds 3 --json out.json

Every round draws fresh token-id prompts (so no server answers a round from a prefix cache
filled by an earlier one) and sends the same prompts to each server, in an order that rotates
from round to round, so drift on a noisy machine falls on every server alike. The prompts
come from `--seed` (by default a fresh one per invocation, printed and kept in the JSON):
a second run against servers still up must not meet the prompts the first one left in their
caches, and `--seed` repeats a run on fresh servers. Start the
servers yourself, with the settings you want compared, and record them with `--note`.

TTFT is when the first text arrives. A request whose tokens never form a complete character
until its end (a random-weight model generates such byte runs) has no TTFT at a server that
drops the incomplete bytes, and its end-to-end time at one that flushes them: the mean would
then cover different requests per server. So beside each server's own TTFT the compare
reports `ttft_common_ms` / `ttft_common_p50_ms`: over the requests for which every server of
the round streamed text, the same prompts for all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.benchmark.client import ClientConfig
from splitserve.benchmark.metrics import compute_metrics
from splitserve.benchmark.runner import RunConfig, run_benchmark
from splitserve.benchmark.workloads import WorkloadConfig, build_workload


@dataclass
class Server:
    name: str
    url: str
    model: str


def parse_server(text: str) -> Server:
    parts = text.split(",")
    if len(parts) != 3 or not all(parts):
        raise argparse.ArgumentTypeError(f"--server takes NAME,URL,MODEL, got {text!r}")
    return Server(*parts)


def run_order(servers: list[Server], round_index: int) -> list[Server]:
    """The servers of a round, rotated by the round's number."""
    k = round_index % len(servers)
    return servers[k:] + servers[:k]


def round_seed(seed: int, round_index: int, concurrency: int) -> int:
    """The prompts' seed of one round at one concurrency: distinct for every pair."""
    return seed + 1000 * round_index + concurrency


def measure(server: Server, workload: WorkloadConfig, concurrency: int) -> dict:
    client = ClientConfig(base_url=server.url, model=server.model, ignore_eos=True)
    outcome = asyncio.run(run_benchmark(build_workload(workload), client,
                                        RunConfig(max_concurrency=concurrency, progress=False)))
    m = compute_metrics(outcome.results, outcome.duration_s, [50])
    # the median TTFT beside the mean: on a shared machine one scheduling stall of the client
    # (docs/benchmarks.md measured 100-600 ms) moves a round's mean, not its median
    ttfts: list[float | None] = [None] * len(outcome.results)  # by prompt, in workload order
    for r in outcome.results:
        index = int(r.request_id.rsplit("-", 1)[1])
        ttfts[index] = (r.token_times[0] - r.start) * 1000.0 if r.success and r.token_times else None
    return {"output_tok_s": m.output_throughput, "ttft_ms": m.ttft_ms["mean"], "ttft_p50_ms": m.ttft_ms["median"],
            "itl_ms": m.itl_ms["mean"], "failed": m.failed, "ttft_by_request_ms": ttfts}


def add_common_ttft(runs: list[dict]) -> None:
    """The runs of one round at one concurrency (one per server, same prompts): each gets its
    TTFT mean and median over the requests every server streamed text for."""
    common = [i for i in range(len(runs[0]["ttft_by_request_ms"]))
              if all(r["ttft_by_request_ms"][i] is not None for r in runs)]
    for r in runs:
        values = [r["ttft_by_request_ms"][i] for i in common]
        r["ttft_common_ms"] = statistics.fmean(values) if values else None
        r["ttft_common_p50_ms"] = _median(values)
        r["ttft_common_requests"] = len(common)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(value: float | None, width: int = 0) -> str:
    return f"{value:>{width}.0f}" if value is not None else f"{'-':>{width}}"


def describe_run(name: str, result: dict) -> str:
    """One progress line: a run with failed requests says so (its latencies cover the rest)."""
    failed = f", {result['failed']} FAILED" if result["failed"] else ""
    return (f"{name}: {result['output_tok_s']:.0f} tok/s, TTFT {_ms(result['ttft_ms'])} ms "
            f"(p50 {_ms(result['ttft_p50_ms'])}){failed}")


def summarize(runs: list[dict], servers: list[Server]) -> list[dict]:
    """Per concurrency and server: medians over the rounds, and the ratio to the first server."""
    rows = []
    for c in sorted({r["concurrency"] for r in runs}):
        medians = {}
        for s in servers:
            mine = [r for r in runs if r["concurrency"] == c and r["server"] == s.name]
            # a round where every request failed has no latencies: medians of the others
            medians[s.name] = {k: _median([r[k] for r in mine if r.get(k) is not None])
                               for k in ("output_tok_s", "ttft_ms", "ttft_p50_ms", "itl_ms", "ttft_common_ms",
                                         "ttft_common_p50_ms")}
            medians[s.name]["failed"] = sum(r["failed"] for r in mine)
        base = medians[servers[0].name]["output_tok_s"]
        for s in servers:
            rows.append({"concurrency": c, "server": s.name, **medians[s.name],
                         "tok_s_ratio_to_first": medians[s.name]["output_tok_s"] / base if base else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splitserve bench compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", type=parse_server, action="append", required=True,
                    help="NAME,URL,MODEL (twice or more; the first is the one ratios refer to)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", default="64:512")
    ap.add_argument("--output-len", default="64:128")
    ap.add_argument("--token-id-range", default="100:1000", help="random prompt ids are drawn from [LO, HI)")
    ap.add_argument("--seed", type=int, help="base seed of the rounds' prompts (default: a fresh one)")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds of quiet before each measurement, so what a server does after its run "
                         "(freeing memory, spinning threads down) does not land on the next server's run")
    ap.add_argument("--note", default="", help="the servers' versions and settings, kept in the JSON")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    if len(ns.server) < 2 or ns.rounds < 1:
        ap.error("give at least two --server and --rounds >= 1")
    span = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    seed = ns.seed if ns.seed is not None else random.SystemRandom().randrange(1, 2**31)
    print(f"[compare] prompts from --seed {seed}", flush=True)
    runs = []
    for rnd in range(ns.rounds):
        for c in (int(x) for x in ns.concurrency.split(",")):
            workload = WorkloadConfig(num_prompts=ns.requests, input_len=span(ns.input_len),
                                      output_len=span(ns.output_len), token_id_range=span(ns.token_id_range),
                                      seed=round_seed(seed, rnd, c))
            this_round = []
            for s in run_order(ns.server, rnd):
                time.sleep(ns.pause)
                result = measure(s, workload, c)
                this_round.append({"round": rnd, "concurrency": c, "server": s.name, **result})
                print(f"[compare] round {rnd + 1}/{ns.rounds} concurrency {c} {describe_run(s.name, result)}",
                      flush=True)
            add_common_ttft(this_round)
            runs.extend(this_round)
    rows = summarize(runs, ns.server)
    print(f"{'concurrency':>11} {'server':>14} {'tok/s':>8} {'ratio':>6} {'TTFT ms':>8} {'TTFT p50':>8} "
          f"{'ITL ms':>7} {'TTFT common':>11} {'p50':>5}")
    for r in rows:
        ratio = r["tok_s_ratio_to_first"]
        print(f"{r['concurrency']:>11} {r['server']:>14} {r['output_tok_s']:>8.0f} "
              f"{ratio if ratio is not None else float('nan'):>6.2f} {_ms(r['ttft_ms'], 8)} "
              f"{_ms(r['ttft_p50_ms'], 8)} {r['itl_ms'] if r['itl_ms'] is not None else float('nan'):>7.1f} "
              f"{_ms(r['ttft_common_ms'], 11)} {_ms(r['ttft_common_p50_ms'], 5)}")
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps({
            "benchmark": "compare", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "note": ns.note,
            "command": "splitserve bench compare " + " ".join(argv or sys.argv[1:]), "seed": seed,
            "servers": [vars(s) for s in ns.server], "runs": runs, "summary": rows}, indent=2) + "\n")
    failed = {r["server"]: r["failed"] for r in rows if r["failed"]}
    if failed:  # a server that failed requests was not measured on the same work as the others
        print(f"[compare] requests failed ({failed} over all rounds): these numbers do not compare like with "
              "like; see the servers' logs, then run again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
