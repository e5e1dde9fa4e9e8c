"""The planner: given a request mix, SLOs and a worker budget, the prefill:decode
split that maximizes goodput per worker.

Every candidate (P prefill, D decode, P + D <= budget, D >= 1) is judged by a
simulation of the same trace. The search is exact, and cheaper than trying every
split: goodput can never exceed the offered rate, so a cluster of n workers scores
at most rate / n. Sizes are tried from small to large and a size is skipped once
that bound cannot beat the best score found (every split of a size is simulated).
`brute_force` tries everything; the tests check both agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from splitserve.simulator.costs import CostModel
from splitserve.simulator.report import SimSummary, summarize
from splitserve.simulator.simulator import ClusterConfig, simulate
from splitserve.simulator.workload import Trace


@dataclass
class Candidate:
    num_prefill: int
    num_decode: int
    goodput: float
    summary: SimSummary

    @property
    def workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def goodput_per_worker(self) -> float:
        return self.goodput / self.workers


@dataclass
class Plan:
    best: Candidate
    evaluated: list[Candidate] = field(default_factory=list)

    def table(self) -> list[dict]:
        return [{"prefill": c.num_prefill, "decode": c.num_decode, "goodput": c.goodput,
                 "goodput_per_worker": c.goodput_per_worker, "mean_ttft_ms": c.summary.mean_ttft_ms,
                 "mean_itl_ms": c.summary.mean_itl_ms} for c in self.evaluated]


Evaluator = Callable[[int, int], Candidate]


def make_evaluator(trace: Trace, costs: CostModel, base: ClusterConfig, slo_ttft_ms: float | None,
                   slo_tpot_ms: float | None) -> Evaluator:
    if slo_ttft_ms is None and slo_tpot_ms is None:
        raise ValueError("the planner needs at least one SLO (TTFT and/or TPOT, in ms)")
    cache: dict[tuple[int, int], Candidate] = {}

    def evaluate(p: int, d: int) -> Candidate:
        if (p, d) not in cache:
            result = simulate(trace, costs, replace(base, num_prefill=p, num_decode=d))
            summary = summarize(result, slo_ttft_ms, slo_tpot_ms)
            cache[(p, d)] = Candidate(p, d, summary.goodput or 0.0, summary)
        return cache[(p, d)]

    return evaluate


def _better(a: Candidate, b: Candidate | None) -> bool:
    """Higher goodput per worker; ties go to fewer workers, then fewer prefill workers."""
    if b is None:
        return True
    ka = (round(a.goodput_per_worker, 9), -a.workers, -a.num_prefill)
    kb = (round(b.goodput_per_worker, 9), -b.workers, -b.num_prefill)
    return ka > kb


def brute_force(evaluate: Evaluator, budget: int) -> Plan:
    best, seen = None, []
    for n in range(1, budget + 1):
        for p in range(0, n):
            c = evaluate(p, n - p)
            seen.append(c)
            if _better(c, best):
                best = c
    return Plan(best, seen)


def plan_split(evaluate: Evaluator, budget: int, goodput_bound: float) -> Plan:
    """`goodput_bound`: requests/s no split can exceed: the trace's requests over its
    arrival span (every request finishes after the last one arrives)."""
    if budget < 1:
        raise ValueError(f"worker budget must be >= 1, got {budget}")
    best, seen = None, []
    for n in range(1, budget + 1):
        if best is not None and goodput_bound / n <= best.goodput_per_worker:
            break  # a cluster this large can at best tie, and ties go to fewer workers
        for p in range(n):
            c = evaluate(p, n - p)
            seen.append(c)
            if _better(c, best):
                best = c
    return Plan(best, seen)


def goodput_bound(trace: Trace) -> float:
    span = float(trace.arrival[-1] - trace.arrival[0])
    return len(trace) / span if span > 0 else float("inf")
