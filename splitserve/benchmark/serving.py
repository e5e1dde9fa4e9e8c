"""`splitserve bench --base-url URL --model NAME ...`: load-test an OpenAI-compatible
server and report vLLM-defined serving metrics, as text, JSON and PNG plots.

Examples:
  splitserve bench --base-url http://127.0.0.1:8000 --model demo --request-rate 4
  splitserve bench --base-url http://127.0.0.1:8000 --model demo \\
      --workload prefix-repetition --num-prefixes 8 --suffixes-per-prefix 16 \\
      --sweep-rates 1,2,4,inf --result-file out/prefix.json --plot-dir out/
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from typing import Any

from splitserve.benchmark.arrivals import describe
from splitserve.benchmark.metrics import compute_metrics
from splitserve.benchmark.options import BenchOptions, parse_args
from splitserve.benchmark.plots import plot_latency_vs_rate, plot_ttft_cdf
from splitserve.benchmark.prompt_tokens import (
    PromptFitter,
    PromptSizeError,
    local_counter,
    server_counter,
)
from splitserve.benchmark.results import (
    build_document,
    format_report,
    format_sweep_table,
    rate_json,
    run_record,
)
from splitserve.benchmark.runner import RunOutcome, run_benchmark
from splitserve.benchmark.workloads import build_workload, total_requests


def config_record(opts: BenchOptions) -> dict[str, Any]:
    """Everything needed to rerun the benchmark; never the API key."""
    c, r = opts.client, opts.run
    return {
        "label": opts.label, "base_url": c.base_url, "endpoint": c.endpoint, "model": c.model,
        "temperature": c.temperature, "ignore_eos": c.ignore_eos,
        "include_usage": c.include_usage, "extra_body": c.extra_body,
        "workload": dataclasses.asdict(opts.workload),
        "request_rates": [rate_json(rate) for rate in opts.rates], "sweep": opts.sweep,
        "arrival": r.arrival, "burstiness": r.burstiness, "max_concurrency": r.max_concurrency,
        "seed": r.seed, "percentiles": opts.percentiles, "goodput_slos_ms": opts.slos_ms,
        "prompt_tokens_counted_by": token_counter_name(opts),
    }


def token_counter_name(opts: BenchOptions) -> str:
    if opts.workload.prompt_format == "ids":
        return "token ids"
    return f"tokenizer {opts.tokenizer}" if opts.tokenizer else opts.client.base_url.rstrip("/") + "/tokenize"


def prompt_fitter(opts: BenchOptions) -> PromptFitter | None:
    """Text prompts are fitted with the served model's tokenizer; ids need none."""
    if opts.workload.prompt_format == "ids":
        return None
    c = opts.client
    count = (local_counter(opts.tokenizer, c.is_chat) if opts.tokenizer
             else server_counter(c.base_url, c.model, c.is_chat, c.api_key))
    return PromptFitter(count)


def run_rates(opts: BenchOptions) -> tuple[list[RunOutcome], list[dict[str, Any]]]:
    outcomes, records = [], []
    fitter = prompt_fitter(opts)
    for i, rate in enumerate(opts.rates):
        # Fresh prompts for every rate of a sweep: repeating them would let a
        # prefix cache serve later rates from the earlier ones.
        workload = dataclasses.replace(opts.workload, seed=opts.workload.seed + i)
        sessions = build_workload(workload, fitter)
        run_cfg = dataclasses.replace(opts.run, request_rate=rate)
        print(f"[bench] {opts.client.url}: {workload.kind}, {total_requests(sessions)} requests "
              f"in {len(sessions)} sessions, {describe(rate, run_cfg.burstiness, run_cfg.arrival)}, "
              f"max concurrency {run_cfg.max_concurrency or 'unlimited'}; prompt tokens counted by "
              f"{token_counter_name(opts)}", flush=True)
        outcome = asyncio.run(run_benchmark(sessions, opts.client, run_cfg))
        metrics = compute_metrics(outcome.results, outcome.duration_s, opts.percentiles,
                                  opts.slos_ms)
        record = run_record(outcome, metrics, opts.save_requests)
        print(format_report(record), flush=True)
        outcomes.append(outcome)
        records.append(record)
    return outcomes, records


def write_outputs(opts: BenchOptions, outcomes: list[RunOutcome],
                  records: list[dict[str, Any]]) -> None:
    if opts.result_file is not None:
        opts.result_file.parent.mkdir(parents=True, exist_ok=True)
        document = build_document(config_record(opts), records)
        opts.result_file.write_text(json.dumps(document, indent=2) + "\n")
        print(f"[bench] results written to {opts.result_file}")
    if opts.plot_dir is not None:
        title = opts.label or f"{opts.workload.kind} on {opts.client.base_url}"
        paths = [plot_ttft_cdf(outcomes, opts.plot_dir / "ttft_cdf.png", f"TTFT CDF: {title}")]
        if opts.sweep:
            paths.append(plot_latency_vs_rate(records, opts.percentiles,
                                              opts.plot_dir / "latency_vs_rate.png", title))
        print("[bench] plots written to " + ", ".join(str(p) for p in paths))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        outcomes, records = run_rates(opts)
    except PromptSizeError as exc:
        print(f"[bench] {exc}", file=sys.stderr)
        return 2
    if opts.sweep:
        print(format_sweep_table(records, max(opts.percentiles)), flush=True)
    try:
        write_outputs(opts, outcomes, records)
    except OSError as exc:
        print(f"[bench] could not write results: {exc}", file=sys.stderr)
        return 1
    if all(record["completed"] == 0 for record in records):
        first = records[0]["errors"][0] if records[0]["errors"] else None
        status = first and (first["status"] if first["status"] is not None else "no response")
        detail = f" [{status}] {first['message']}" if first else ""
        print(f"[bench] every request failed{detail}. Check --base-url {opts.client.base_url}, "
              f"--endpoint {opts.client.endpoint} and --model {opts.client.model} "
              "(e.g. curl the server's /v1/models).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
