"""The simulator on tiny cases whose answers can be computed by hand, and invariants."""

import numpy as np
import pytest

from splitserve.router.policy import PolicyConfig
from splitserve.simulator.costs import AffineCost, CostModel, ServingOverhead, StepCost
from splitserve.simulator.report import summarize
from splitserve.simulator.simulator import ClusterConfig, simulate
from splitserve.simulator.workload import RequestMix, Trace, build_trace

# 10 ms per step + 1 ms per token: a prefill of n tokens takes 10 + n ms, a decode
# step of b sequences 10 + b ms.
FLAT = CostModel(step=StepCost(c_step=0.010, c_token=0.001))


def trace(*requests, prefix_len=0):
    """requests: (arrival s, prompt tokens, output tokens[, group])."""
    rows = [r if len(r) == 4 else (*r, -1) for r in requests]
    return Trace(np.array([r[0] for r in rows], dtype=float), np.array([r[1] for r in rows]),
                 np.array([r[2] for r in rows]), np.array([r[3] for r in rows]),
                 np.array([prefix_len if r[3] >= 0 else 0 for r in rows]))


def local(decode=1, **kw):
    return ClusterConfig(num_prefill=0, num_decode=decode, **kw)


def test_one_request_exact_ttft_and_decode_time():
    r = simulate(trace((0.0, 100, 5)), FLAT, local())
    assert r.first_token[0] == pytest.approx(0.110)  # one prefill step: 10 + 100 ms
    assert r.finish[0] == pytest.approx(0.110 + 4 * 0.011)  # 4 decode steps of one sequence
    s = summarize(r)
    assert s.mean_ttft_ms == pytest.approx(110.0)
    assert s.mean_itl_ms == pytest.approx(11.0)
    assert s.p99_itl_ms == pytest.approx(11.0)


def test_decode_steps_grow_with_context_in_closed_form():
    # attention 1 us per prefill (query, key) pair and per key a decode reads: decode
    # step j (context 50 + j, reading 51 + j keys) costs 10 + 1 ms + (51 + j) us; the
    # closed-form segment is checked against a plain loop.
    costs = CostModel(step=StepCost(c_step=0.010, c_token=0.001, c_attn=1e-6, c_ctx=1e-6))
    r = simulate(trace((0.0, 50, 20)), costs, local())
    prefill = 0.010 + 0.050 + 1e-6 * 50 * (0 + 51 / 2)
    decode = sum(0.011 + 1e-6 * (50 + j + 1) for j in range(19))
    assert r.first_token[0] == pytest.approx(prefill)
    assert r.finish[0] == pytest.approx(prefill + decode)


def test_arrival_mid_segment_joins_at_the_next_step_boundary():
    # A: prefill 0..20 ms, then decode steps of 11 ms ending at 31, 42, 53 ms...
    # B arrives at 50 ms and is admitted at the 53 ms boundary: one mixed step
    # (A's decode + B's 20-token prefill) of 10 + 21 = 31 ms ends at 84 ms: B's first
    # token. Then steps of both (12 ms): B's last token at 96 ms. A decodes its last
    # 4 tokens alone: 96 + 4 x 11 = 140 ms.
    r = simulate(trace((0.0, 10, 10), (0.050, 20, 2)), FLAT, local())
    assert r.first_token[0] == pytest.approx(0.020)
    assert r.first_token[1] == pytest.approx(0.084)
    assert r.finish[1] == pytest.approx(0.096)
    assert r.finish[0] == pytest.approx(0.140)


def test_disaggregated_request_pays_prefill_transfer_and_joins_decode():
    costs = CostModel(step=StepCost(c_step=0.010, c_token=0.001), transfer=AffineCost(0.002, 1e-9),
                      kv_bytes_per_token=1000, block_size=16)
    cfg = ClusterConfig(num_prefill=1, num_decode=1, policy=PolicyConfig(disagg_min_uncached_tokens=256))
    r = simulate(trace((0.0, 300, 3)), costs, cfg)
    # prefill step 10 + 300 ms; 19 blocks of 16 tokens x 1000 bytes: 2 ms + 0.304 ms
    first = 0.310 + 0.002 + 19 * 16 * 1000 * 1e-9
    assert r.first_token[0] == pytest.approx(first)
    assert r.finish[0] == pytest.approx(first + 2 * 0.011)
    assert r.disaggregated == 1
    short = simulate(trace((0.0, 100, 3)), costs, cfg)  # under the threshold: local
    assert short.disaggregated == 0
    assert short.first_token[0] == pytest.approx(0.110)


def test_serving_overhead_and_routing_time_are_added_once():
    costs = CostModel(step=StepCost(c_step=0.010, c_token=0.001), routing_s=0.001,
                      serving=ServingOverhead(first_token_s=0.005, per_token_s=0.002))
    s = summarize(simulate(trace((0.0, 100, 5)), costs, local()))
    assert s.mean_ttft_ms == pytest.approx(1 + 110 + 5)
    assert s.mean_itl_ms == pytest.approx(11 + 2)
    assert s.mean_e2el_ms == pytest.approx(1 + 110 + 5 + 4 * 13)


def test_workers_sharing_too_few_cores_run_slower():
    reqs = [(0.0, 100, 1), (0.0, 100, 1)]
    alone = simulate(trace(*reqs), FLAT, local(decode=2, routing_mode="round-robin"))
    assert alone.first_token.tolist() == pytest.approx([0.110, 0.110])
    # one core: the second worker starts while the first is busy, at half speed
    shared = simulate(trace(*reqs), FLAT, local(decode=2, routing_mode="round-robin", cpu_cores=1))
    assert sorted(shared.first_token.tolist()) == pytest.approx([0.110, 0.220])
    # a frontend using half a core slows even a lone worker on one core
    costs = CostModel(step=FLAT.step, serving=ServingOverhead(frontend_load=0.5))
    one = simulate(trace((0.0, 100, 1)), costs, local(cpu_cores=1))
    assert one.first_token[0] == pytest.approx(0.165)


def test_prefix_routing_keeps_a_group_on_one_worker_and_hits_its_cache():
    # 4 workers, 2 groups with a 160-token (10 block) prefix, requests spaced apart
    reqs = [(i * 1.0, 176, 2, i % 2) for i in range(8)]
    prefix = simulate(trace(*reqs, prefix_len=160), FLAT, local(decode=4, routing_mode="prefix"))
    # the first request of each group misses; the other 6 reuse 160 tokens
    assert prefix.prefix_hit_tokens == 6 * 160
    rr = simulate(trace(*reqs, prefix_len=160), FLAT, local(decode=4, routing_mode="round-robin"))
    # round-robin visits worker k with groups (k % 2): each worker holds one group, first visit misses
    assert rr.prefix_hit_tokens == 4 * 160
    assert summarize(prefix).mean_ttft_ms < summarize(rr).mean_ttft_ms


def test_cache_capacity_evicts_least_recently_used_group():
    # cache of 10 blocks holds one 160-token prefix: alternating groups always miss
    reqs = [(i * 1.0, 176, 2, i % 2) for i in range(6)]
    r = simulate(trace(*reqs, prefix_len=160), FLAT, local(cache_blocks=10))
    assert r.prefix_hit_tokens == 0
    same = [(i * 1.0, 176, 2, 0) for i in range(6)]
    assert simulate(trace(*same, prefix_len=160), FLAT, local(cache_blocks=10)).prefix_hit_tokens == 5 * 160


def test_invariants_on_a_random_mix():
    costs = CostModel(step=StepCost(2e-3, 3e-4, 5e-5, 2e-8, 6e-8), transfer=AffineCost(1e-3, 1e-9),
                      kv_bytes_per_token=2048)
    mix = RequestMix(num_requests=2000, rate=40, prompt_len=(16, 512), long_fraction=0.2, long_len=(1024, 2048),
                     output_len=(1, 64), num_prefixes=20, prefix_len=128, prefix_fraction=0.5, seed=3)
    tr = build_trace(mix)
    r = simulate(tr, costs, ClusterConfig(num_prefill=2, num_decode=3))
    assert np.all(r.first_token >= tr.arrival)
    assert np.all(r.finish >= r.first_token)
    one = tr.output_len == 1
    assert np.all(r.finish[one] == r.first_token[one])
    # every decode step of a request costs at least one single-sequence step
    min_step = costs.step.decode(1, 0)
    assert np.all(r.finish - r.first_token >= (tr.output_len - 1) * min_step - 1e-9)
    s = summarize(r, slo_ttft_ms=1e9, slo_tpot_ms=1e9)
    assert s.goodput == pytest.approx(s.request_throughput)  # every request meets infinite SLOs
    assert 0 < s.disaggregated_fraction < 1


def test_bad_configs_are_rejected_clearly():
    with pytest.raises(ValueError, match="need >= 1 decode worker"):
        simulate(trace((0.0, 10, 2)), FLAT, ClusterConfig(num_prefill=1, num_decode=0))
    with pytest.raises(ValueError, match="routing mode"):
        simulate(trace((0.0, 10, 2)), FLAT, local(routing_mode="fastest"))
    with pytest.raises(ValueError, match="arrivals must be sorted"):
        simulate(trace((1.0, 10, 2), (0.0, 10, 2)), FLAT, local())
    with pytest.raises(ValueError, match="rate must be > 0"):
        build_trace(RequestMix(rate=0))
