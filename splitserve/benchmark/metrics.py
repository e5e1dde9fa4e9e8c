"""Serving metrics with the definitions of vLLM's serving benchmark, as pure
functions (timestamps in, numbers out) so that each definition is unit-tested.

- TTFT: from sending the request to the first streamed chunk that carries a token
  (a chat stream's role-only first chunk and the final usage chunk carry none).
- ITL: the gaps between consecutive token-carrying chunks. A chunk that holds
  several tokens is still one gap, as in vLLM.
- E2E latency (e2el): from sending the request to the end of the stream ([DONE]).
- TPOT: (e2el - ttft) / (output_tokens - 1), defined for requests with more than one
  output token; for goodput a request with one token has TPOT 0 (vLLM does the same).
- Throughputs divide by the benchmark duration (first send to last completion).
- Goodput: completed requests per second that met every given SLO (milliseconds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from splitserve.benchmark.request import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")


def stream_timings(start: float, token_times: Sequence[float],
                   end: float) -> tuple[float | None, list[float], float]:
    """(ttft, itls, e2el) in seconds from the send time, the arrival times of the
    token-carrying chunks and the end of the stream. ttft is None when no token came."""
    if not token_times:
        return None, [], end - start
    itls = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return token_times[0] - start, itls, end - start


def time_per_output_token(ttft: float | None, e2el: float, output_tokens: int) -> float | None:
    if ttft is None or output_tokens <= 1:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentile_key(p: float) -> str:
    return f"p{p:g}"


def summarize_ms(values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float | None]:
    """mean, median, std (population, as numpy) and percentiles, in milliseconds.
    Every field is None when there is no sample (e.g. no request had two tokens)."""
    keys = ["mean", "median", "std"] + [percentile_key(p) for p in percentiles]
    if not values_s:
        return dict.fromkeys(keys)
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms)
    out: dict[str, float | None] = {
        "mean": mean,
        "median": percentile(ms, 50.0),
        "std": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)),
    }
    for p in percentiles:
        out[percentile_key(p)] = percentile(ms, p)
    return out


@dataclass
class RequestMetrics:
    ttft: float | None
    itls: list[float]
    e2el: float
    tpot: float | None


def request_metrics(result: RequestResult) -> RequestMetrics:
    if not result.success or result.end is None:
        raise ValueError(f"request {result.request_id} did not complete; it has no latency metrics")
    ttft, itls, e2el = stream_timings(result.start, result.token_times, result.end)
    return RequestMetrics(ttft, itls, e2el, time_per_output_token(ttft, e2el, result.output_tokens))


def meets_slos(m: RequestMetrics, slos_ms: dict[str, float]) -> bool:
    """A request that streamed no token never delivered a first token: it misses a
    TTFT SLO. TPOT of a one-token request counts as 0, as in vLLM."""
    measured = {"ttft": m.ttft, "tpot": m.tpot if m.tpot is not None else 0.0, "e2el": m.e2el}
    for name, limit_ms in slos_ms.items():
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}; use one of {', '.join(SLO_METRICS)}")
        value = measured[name]
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2el_ms: dict[str, float | None]
    input_token_source: str
    output_token_source: str


def token_source(sources: Sequence[str], fallback: str) -> str:
    """'usage', the fallback name, or 'mixed (U usage, C <fallback>)'."""
    n_usage = sum(1 for s in sources if s == "usage")
    if n_usage == len(sources):
        return "usage"
    if n_usage == 0:
        return fallback
    return f"mixed ({n_usage} usage, {len(sources) - n_usage} {fallback})"


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    percentiles: Sequence[float], slos_ms: dict[str, float] | None = None,
                    ) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    done = [r for r in results if r.success]
    per_request = [request_metrics(r) for r in done]
    ttfts = [m.ttft for m in per_request if m.ttft is not None]
    tpots = [m.tpot for m in per_request if m.tpot is not None]
    itls = [gap for m in per_request for gap in m.itls]
    e2els = [m.e2el for m in per_request]
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    goodput = None
    if slos_ms:
        goodput = sum(1 for m in per_request if meets_slos(m, slos_ms)) / duration_s
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration_s,
        request_goodput=goodput,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=summarize_ms(ttfts, percentiles),
        tpot_ms=summarize_ms(tpots, percentiles),
        itl_ms=summarize_ms(itls, percentiles),
        e2el_ms=summarize_ms(e2els, percentiles),
        input_token_source=token_source([r.prompt_tokens_source for r in done], "estimate"),
        output_token_source=token_source([r.output_tokens_source for r in done], "chunks"),
    )
