"""Simulation results as the serving benchmark reports them (bench/metrics.py
definitions): TTFT, ITL (gaps between streamed tokens), TPOT, E2E latency,
throughputs over first arrival → last completion, and goodput under SLOs.

The serving overhead measured by `splitserve profile` (router, gRPC, SSE) is added
here: once to each first token, and to every streamed gap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from splitserve.simulator.simulator import SimResult


@dataclass
class SimSummary:
    requests: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    goodput: float | None  # requests/s meeting every SLO; None without SLOs
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_itl_ms: float | None
    p99_itl_ms: float | None
    mean_tpot_ms: float | None
    mean_e2el_ms: float
    disaggregated_fraction: float
    prefix_hit_rate: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, p: float) -> float:
    """The smallest value with at least p% of the total weight at or below it."""
    if len(values) == 0:
        raise ValueError("percentile of no samples")
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    idx = int(np.searchsorted(cum, cum[-1] * p / 100.0))
    return float(values[order][min(idx, len(values) - 1)])


def summarize(result: SimResult, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> SimSummary:
    serving = result.costs.serving
    out = result.output_len.astype(float)
    ttft = result.first_token - result.arrival + serving.first_token_s
    gaps = np.maximum(out - 1, 0)
    decode_span = result.finish - result.first_token + serving.per_token_s * gaps
    e2el = ttft + decode_span
    duration = float(np.max(result.arrival + e2el) - np.min(result.arrival))
    duration = duration if duration > 0 else float("nan")
    multi = gaps > 0
    tpot = decode_span[multi] / gaps[multi]
    itl_values, itl_weights = result.itl_samples
    mean_itl = p99_itl = None
    if gaps.sum() > 0:
        mean_itl = float(decode_span.sum() / gaps.sum()) * 1000
        if len(itl_values):
            p99_itl = (weighted_percentile(itl_values, itl_weights, 99.0) + serving.per_token_s) * 1000
    goodput = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        ok = np.ones(len(ttft), dtype=bool)
        if slo_ttft_ms is not None:
            ok &= ttft * 1000 <= slo_ttft_ms
        if slo_tpot_ms is not None:  # a one-token request has TPOT 0 (as vLLM and splitserve bench)
            tpot_all = np.where(multi, decode_span / np.maximum(gaps, 1), 0.0)
            ok &= tpot_all * 1000 <= slo_tpot_ms
        goodput = float(ok.sum() / duration)
    n = len(ttft)
    return SimSummary(
        requests=n, duration_s=duration, request_throughput=n / duration,
        output_throughput=float(out.sum() / duration), goodput=goodput,
        mean_ttft_ms=float(ttft.mean() * 1000), median_ttft_ms=float(np.median(ttft) * 1000),
        p99_ttft_ms=float(np.percentile(ttft, 99) * 1000), mean_itl_ms=mean_itl, p99_itl_ms=p99_itl,
        mean_tpot_ms=float(tpot.mean() * 1000) if len(tpot) else None,
        mean_e2el_ms=float(e2el.mean() * 1000), disaggregated_fraction=result.disaggregated / n,
        prefix_hit_rate=(result.prefix_hit_tokens / result.prefix_query_tokens
                         if result.prefix_query_tokens else None))
