"""The planner's split equals a brute-force search over every split."""

import pytest

from splitserve.simulator.costs import AffineCost, CostModel, StepCost
from splitserve.simulator.planner import brute_force, goodput_bound, make_evaluator, plan_split
from splitserve.simulator.simulator import ClusterConfig
from splitserve.simulator.workload import RequestMix, build_trace

COSTS = CostModel(step=StepCost(2e-3, 4e-4, 5e-5, 1e-7, 2e-7), transfer=AffineCost(1e-3, 1e-9), kv_bytes_per_token=2048)

MIXES = {
    "prefill-heavy": RequestMix(num_requests=300, rate=6, prompt_len=(512, 1536), output_len=(4, 16), seed=1),
    "decode-heavy": RequestMix(num_requests=300, rate=6, prompt_len=(32, 128), output_len=(64, 256), seed=2),
    "mixed": RequestMix(num_requests=300, rate=5, prompt_len=(32, 128), long_fraction=0.3, long_len=(1024, 2048),
                        output_len=(16, 96), seed=3),
}


@pytest.mark.parametrize("name", sorted(MIXES))
@pytest.mark.parametrize(("slo_ttft", "slo_tpot"), [(1000.0, 40.0), (300.0, None)])
def test_planner_matches_brute_force(name, slo_ttft, slo_tpot):
    trace = build_trace(MIXES[name])
    evaluate = make_evaluator(trace, COSTS, ClusterConfig(), slo_ttft, slo_tpot)
    budget = 5
    exhaustive = brute_force(evaluate, budget)
    planned = plan_split(evaluate, budget, goodput_bound(trace))
    assert (planned.best.num_prefill, planned.best.num_decode) == (exhaustive.best.num_prefill,
                                                                  exhaustive.best.num_decode)
    assert planned.best.goodput_per_worker == exhaustive.best.goodput_per_worker
    assert len(planned.evaluated) <= len(exhaustive.evaluated)


def test_planner_prefers_prefill_workers_for_long_prompts_and_decode_workers_for_long_outputs():
    picks = {}
    for name in ("prefill-heavy", "decode-heavy"):
        trace = build_trace(MIXES[name])
        evaluate = make_evaluator(trace, COSTS, ClusterConfig(), 1000.0, 40.0)
        best = plan_split(evaluate, 5, goodput_bound(trace)).best
        picks[name] = best.num_prefill / best.workers
    assert picks["prefill-heavy"] > picks["decode-heavy"]


def test_planner_needs_an_slo_and_a_budget():
    trace = build_trace(RequestMix(num_requests=10))
    with pytest.raises(ValueError, match="at least one SLO"):
        make_evaluator(trace, COSTS, ClusterConfig(), None, None)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        plan_split(make_evaluator(trace, COSTS, ClusterConfig(), 100.0, None), 0, 1.0)
