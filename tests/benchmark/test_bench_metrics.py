"""The metric definitions on synthetic timestamps: exact numbers, no I/O."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitserve.benchmark.metrics import (
    compute_metrics,
    meets_slos,
    percentile,
    request_metrics,
    stream_timings,
    summarize_ms,
    time_per_output_token,
    token_source,
)
from splitserve.benchmark.request import RequestResult


def done(rid: str, start: float, token_times: list[float], end: float, output_tokens: int,
         prompt_tokens: int = 10, source: str = "usage") -> RequestResult:
    return RequestResult(rid, success=True, start=start, token_times=token_times, end=end,
                         output_tokens=output_tokens, output_tokens_source=source,
                         prompt_tokens=prompt_tokens, prompt_tokens_source=source)


def test_stream_timings_follow_vllm_definitions():
    ttft, itls, e2el = stream_timings(10.0, [10.3, 10.4, 10.5, 10.7], 10.9)
    assert ttft == pytest.approx(0.3)
    assert itls == pytest.approx([0.1, 0.1, 0.2])  # gaps between token chunks only
    assert e2el == pytest.approx(0.9)  # to [DONE], not to the last token


def test_stream_without_tokens_has_no_ttft():
    assert stream_timings(1.0, [], 1.5) == (None, [], 0.5)


def test_tpot_excludes_the_first_token_and_uses_token_count_not_chunks():
    # 2 chunks but 5 tokens: (e2el - ttft) / (5 - 1)
    assert time_per_output_token(0.3, 0.9, 5) == pytest.approx(0.15)
    assert time_per_output_token(0.3, 0.9, 1) is None
    assert time_per_output_token(None, 0.9, 5) is None


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                    list(np.random.default_rng(7).exponential(size=101))])
@pytest.mark.parametrize("p", [0.0, 1.0, 25.0, 50.0, 90.0, 99.0, 99.9, 100.0])
def test_percentile_matches_numpy_linear(values, p):
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summary_in_ms_with_population_std_and_chosen_percentiles():
    s = summarize_ms([0.1, 0.2, 0.3, 0.4], [50, 90, 99.9])
    assert s["mean"] == pytest.approx(250.0)
    assert s["median"] == pytest.approx(250.0)
    assert s["std"] == pytest.approx(float(np.std([100, 200, 300, 400])))
    assert s["p90"] == pytest.approx(370.0)
    assert s["p99.9"] == pytest.approx(399.7)
    assert list(s) == ["mean", "median", "std", "p50", "p90", "p99.9"]
    assert summarize_ms([], [99]) == {"mean": None, "median": None, "std": None, "p99": None}


def test_compute_metrics_on_known_requests():
    results = [
        done("a", 0.0, [0.2, 0.3, 0.4], 0.5, output_tokens=3, prompt_tokens=10),
        done("b", 1.0, [1.4, 1.6], 1.6, output_tokens=5, prompt_tokens=20),
        RequestResult("c", success=False, status=503, error="overloaded"),
    ]
    m = compute_metrics(results, duration_s=2.0, percentiles=[50])
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 8)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(19.0)
    assert m.request_goodput is None
    assert m.ttft_ms["mean"] == pytest.approx(300.0)  # 200 and 400
    # TPOT: a (0.5-0.2)/2 = 150 ms, b (0.6-0.4)/4 = 50 ms
    assert m.tpot_ms["mean"] == pytest.approx(100.0)
    # ITL pools the gaps of all requests: 100, 100, 200
    assert m.itl_ms["mean"] == pytest.approx(400.0 / 3)
    assert m.itl_ms["median"] == pytest.approx(100.0)
    assert m.e2el_ms["mean"] == pytest.approx(550.0)
    assert (m.input_token_source, m.output_token_source) == ("usage", "usage")


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        done("fast", 0.0, [0.1, 0.2], 0.2, output_tokens=2),  # ttft 100, tpot 100, e2el 200
        done("slow-first", 0.0, [0.6, 0.7], 0.7, output_tokens=2),  # ttft 600
        done("slow-decode", 0.0, [0.1, 0.5], 0.5, output_tokens=2),  # tpot 400
        done("one-token", 0.0, [0.1], 0.1, output_tokens=1),  # tpot counts as 0
        done("no-token", 0.0, [], 0.1, output_tokens=0),  # never delivered a first token
    ]
    m = compute_metrics(results, 2.0, [50], {"ttft": 500, "tpot": 200})
    assert m.request_goodput == pytest.approx(2 / 2.0)  # fast and one-token
    m = compute_metrics(results, 2.0, [50], {"e2el": 250})
    # fast (200), one-token and no-token (100) meet it; slow-first (700), slow-decode (500) do not
    assert m.request_goodput == pytest.approx(3 / 2.0)


def test_slo_boundary_is_inclusive_and_unknown_metric_is_rejected():
    rm = request_metrics(done("x", 0.0, [0.5], 1.0, output_tokens=1))
    assert meets_slos(rm, {"ttft": 500.0})
    assert not meets_slos(rm, {"ttft": 499.0})
    with pytest.raises(ValueError, match="unknown SLO metric 'itl'"):
        meets_slos(rm, {"itl": 10})


def test_token_source_says_where_counts_came_from():
    assert token_source(["usage", "usage"], "chunks") == "usage"
    assert token_source(["chunks"], "chunks") == "chunks"
    assert token_source(["usage", "chunks", "chunks"], "chunks") == "mixed (1 usage, 2 chunks)"


def test_metrics_of_a_run_where_everything_failed_are_empty_not_crashing():
    m = compute_metrics([RequestResult("a", error="refused")], 1.0, [99], {"ttft": 1})
    assert m.completed == 0 and m.failed == 1 and m.request_goodput == 0.0
    assert m.ttft_ms["mean"] is None and m.ttft_ms["p99"] is None
    with pytest.raises(ValueError, match="positive"):
        compute_metrics([], 0.0, [50])
    assert math.isclose(compute_metrics([], 1.0, [50]).request_throughput, 0.0)
