"""Results: the JSON document (`--result-file`), its schema, and the printed report.

One document holds one or more runs (one per request rate in a sweep). Times are
milliseconds, throughputs per second; JSON has no infinity, so an unlimited request
rate is written as the string "inf". Summaries with no sample are null.
"""

from __future__ import annotations

import math
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from splitserve.benchmark.metrics import BenchmarkMetrics, request_metrics
from splitserve.benchmark.request import RequestResult
from splitserve.benchmark.runner import RunOutcome

SCHEMA_VERSION = 1
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")

_number = {"type": "number"}
_maybe_number = {"type": ["number", "null"]}
_rate = {"oneOf": [{"type": "number", "exclusiveMinimum": 0}, {"const": "inf"}]}
_summary = {
    "type": "object",
    "required": ["mean", "median", "std"],
    "properties": {"mean": _maybe_number, "median": _maybe_number, "std": _maybe_number},
    "patternProperties": {r"^p\d+(\.\d+)?$": _maybe_number},
    "additionalProperties": False,
}
_error = {
    "type": "object",
    "required": ["status", "message", "count", "example_request_id"],
    "properties": {"status": {"type": ["integer", "null"]}, "message": {"type": "string"},
                   "count": {"type": "integer", "minimum": 1},
                   "example_request_id": {"type": "string"}},
}
_run = {
    "type": "object",
    "required": ["request_rate", "duration_s", "completed", "failed", "total_input_tokens",
                 "total_output_tokens", "input_token_source", "output_token_source",
                 "request_throughput", "request_goodput", "output_throughput",
                 "total_token_throughput", *LATENCY_KEYS, "errors"],
    "properties": {
        "request_rate": _rate, "duration_s": _number,
        "completed": {"type": "integer", "minimum": 0}, "failed": {"type": "integer", "minimum": 0},
        "total_input_tokens": {"type": "integer"}, "total_output_tokens": {"type": "integer"},
        "input_token_source": {"type": "string"}, "output_token_source": {"type": "string"},
        "request_throughput": _number, "request_goodput": _maybe_number,
        "output_throughput": _number, "total_token_throughput": _number,
        **{key: _summary for key in LATENCY_KEYS},
        "errors": {"type": "array", "items": _error},
        "requests": {"type": "array", "items": {"type": "object"}},
    },
}
RESULT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema_version", "tool", "created", "config", "runs"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "tool": {"const": "splitserve bench"},
        "created": {"type": "string"},
        "config": {"type": "object", "required": ["base_url", "endpoint", "model", "workload"]},
        "runs": {"type": "array", "minItems": 1, "items": _run},
    },
}


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def error_summary(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Failed requests grouped by (status, message), most frequent first."""
    groups: Counter[tuple[int | None, str]] = Counter()
    example: dict[tuple[int | None, str], str] = {}
    for r in results:
        if not r.success:
            key = (r.status, r.error)
            groups[key] += 1
            example.setdefault(key, r.request_id)
    return [{"status": status, "message": message, "count": count,
             "example_request_id": example[(status, message)]}
            for (status, message), count in groups.most_common()]


def request_record(r: RequestResult) -> dict[str, Any]:
    entry: dict[str, Any] = {"request_id": r.request_id, "success": r.success,
                             "send_offset_s": r.send_offset, "prompt_tokens": r.prompt_tokens,
                             "output_tokens": r.output_tokens, "status": r.status}
    if r.success:
        m = request_metrics(r)
        entry.update(ttft_ms=None if m.ttft is None else m.ttft * 1000, e2el_ms=m.e2el * 1000,
                     tpot_ms=None if m.tpot is None else m.tpot * 1000,
                     itl_ms=[gap * 1000 for gap in m.itls])
    else:
        entry["error"] = r.error
    return entry


def run_record(outcome: RunOutcome, metrics: BenchmarkMetrics,
               save_requests: bool = False) -> dict[str, Any]:
    record: dict[str, Any] = {"request_rate": rate_json(outcome.request_rate)}
    record.update({k: v for k, v in vars(metrics).items()})
    record["errors"] = error_summary(outcome.results)
    if save_requests:
        record["requests"] = [request_record(r) for r in outcome.results]
    return record


def build_document(config: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "tool": "splitserve bench",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "config": config, "runs": runs}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_report(run: dict[str, Any]) -> str:
    width = 52
    lines = [" Serving Benchmark Result ".center(width, "="),
             f"{'Request rate (req/s):':<40}{run['request_rate']}"]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40}{value}")

    row("Successful requests:", run["completed"])
    row("Failed requests:", run["failed"])
    row("Benchmark duration (s):", _fmt(run["duration_s"]))
    row("Total input tokens:", f"{run['total_input_tokens']} ({run['input_token_source']})")
    row("Total generated tokens:", f"{run['total_output_tokens']} ({run['output_token_source']})")
    row("Request throughput (req/s):", _fmt(run["request_throughput"]))
    if run["request_goodput"] is not None:
        row("Request goodput (req/s):", _fmt(run["request_goodput"]))
    row("Output token throughput (tok/s):", _fmt(run["output_throughput"]))
    row("Total token throughput (tok/s):", _fmt(run["total_token_throughput"]))
    titles = {"ttft_ms": "Time to First Token", "tpot_ms": "Time per Output Token (excl. 1st)",
              "itl_ms": "Inter-token Latency", "e2el_ms": "End-to-end Latency"}
    for key, title in titles.items():
        name = key.removesuffix("_ms").upper()
        lines.append(f" {title} ".center(width, "-"))
        for stat, value in run[key].items():
            label = stat.capitalize() if stat in ("mean", "median", "std") else stat.upper()
            row(f"{label} {name} (ms):", _fmt(value))
    if run["errors"]:
        lines.append(" Errors ".center(width, "-"))
        for err in run["errors"][:10]:
            status = err["status"] if err["status"] is not None else "no response"
            lines.append(f"{err['count']:>6} x [{status}] {err['message']} "
                         f"(e.g. {err['example_request_id']})")
        if len(run["errors"]) > 10:
            lines.append(f"   ... and {len(run['errors']) - 10} more kinds (see --result-file)")
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep_table(runs: list[dict[str, Any]], percentile: float) -> str:
    """One line per request rate: the numbers a sweep is run to compare."""
    tail = f"p{percentile:g}"
    header = (f"{'rate':>8} {'ok':>6} {'failed':>6} {'req/s':>8} {'goodput':>8} {'out tok/s':>10} "
              f"{'TTFT mean':>10} {'TTFT ' + tail:>10} {'ITL mean':>9} {'ITL ' + tail:>9} "
              f"{'E2E ' + tail:>10}")
    lines = [" Sweep summary (latencies in ms) ".center(len(header), "="), header]
    for run in runs:
        rate = run["request_rate"]
        lines.append(
            f"{rate if isinstance(rate, str) else f'{rate:g}':>8} {run['completed']:>6} "
            f"{run['failed']:>6} {_fmt(run['request_throughput']):>8} "
            f"{_fmt(run['request_goodput']):>8} {_fmt(run['output_throughput'], 1):>10} "
            f"{_fmt(run['ttft_ms']['mean'], 1):>10} {_fmt(run['ttft_ms'].get(tail), 1):>10} "
            f"{_fmt(run['itl_ms']['mean'], 1):>9} {_fmt(run['itl_ms'].get(tail), 1):>9} "
            f"{_fmt(run['e2el_ms'].get(tail), 1):>10}")
    return "\n".join(lines)
