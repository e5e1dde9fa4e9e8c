"""Routing policy: each rule of the cost, the guard, tie-breaking and disaggregation."""

import random
from collections import Counter

import pytest

from splitserve.cluster.messages import LoadReport
from splitserve.router.policy import (
    NoHealthyWorker,
    PolicyConfig,
    choose_prefill,
    route,
)

BS = 16
PROMPT = 2048  # 128 blocks


def load(worker, waiting=0, running=0, kv=0.0, waiting_tokens=0, role="decode"):
    return LoadReport(worker, role, waiting, running, kv, waiting_tokens=waiting_tokens)


def decide(matched, loads, decode=("d1", "d2"), prefill=(), seed=0, **kw):
    cfg = kw.pop("config", PolicyConfig())
    return route(PROMPT, BS, matched, list(decode), list(prefill), loads, random.Random(seed),
                 cfg, **kw)


def test_overlap_wins_between_equally_loaded_workers():
    loads = {"d1": load("d1", running=4), "d2": load("d2", running=4)}
    d = decide({"d2": 100, "d1": 3}, loads)
    assert d.decode_worker == "d2" and d.decode_cached_blocks == 100
    assert d.reason == "best-cost"
    assert d.costs["d2"] == pytest.approx(4 / 32 - 100 / 128)


def test_load_outweighs_a_small_overlap():
    loads = {"d1": load("d1", running=20, kv=0.6), "d2": load("d2")}
    d = decide({"d1": 4}, loads)
    assert d.decode_worker == "d2"


def test_kv_usage_counts_as_load():
    loads = {"d1": load("d1", kv=0.9), "d2": load("d2", kv=0.1)}
    assert decide({}, loads).decode_worker == "d2"


def test_imbalance_guard_sends_to_the_least_loaded_worker():
    loads = {"d1": load("d1", waiting=10, running=30), "d2": load("d2", running=2)}
    d = decide({"d1": 128}, loads)  # d1 holds the whole prompt, yet is swamped
    assert d.decode_worker == "d2"
    assert d.reason == "imbalance-guard(queues 2..40)"


def test_imbalance_guard_needs_both_absolute_and_relative_spread():
    # 0 vs 1 request is "infinitely" unbalanced in ratio but not worth overriding cache
    loads = {"d1": load("d1", running=1), "d2": load("d2")}
    assert decide({"d1": 128}, loads).decode_worker == "d1"
    # 100 vs 120 is a large absolute gap but a small ratio
    loads = {"d1": load("d1", running=100), "d2": load("d2", running=120)}
    assert decide({"d2": 128}, loads).reason == "best-cost"


def test_ties_are_broken_by_load_before_randomness():
    # d1: load 0.5 and half the prompt cached (cost 0); d2: idle, nothing cached (cost 0,
    # with no credit for pulling d1's blocks: tests/router/test_tier_scoring.py has that)
    loads = {"d1": load("d1", running=16), "d2": load("d2")}
    d = decide({"d1": 64}, loads, config=PolicyConfig(peer_credit=0.0))
    assert d.costs == {"d1": 0.0, "d2": 0.0}
    assert (d.decode_worker, d.reason) == ("d2", "tie-least-loaded")


def test_full_ties_are_broken_at_random_not_by_position():
    workers = [f"d{i}" for i in range(8)]
    picks = Counter(decide({}, {}, decode=workers, seed=s).decode_worker for s in range(400))
    assert set(picks) == set(workers)  # every worker gets some
    assert max(picks.values()) < 100  # and none gets most (expected 50 each)
    assert decide({}, {}, decode=workers, seed=3).reason == "tie-random-of-8"


def test_same_seed_same_choice_whatever_the_registry_order():
    workers = [f"d{i}" for i in range(16)]
    for seed in range(20):
        a = decide({}, {}, decode=workers, seed=seed)
        b = decide({}, {}, decode=list(reversed(workers)), seed=seed)
        assert a.decode_worker == b.decode_worker


def test_missing_load_report_counts_as_idle_and_pending_counts_as_load():
    loads = {"d1": load("d1", running=3)}
    assert decide({}, loads).decode_worker == "d2"
    # requests this router sent since d2's last report make it the busier one
    assert decide({}, loads, pending={"d2": 5}).decode_worker == "d1"


def test_short_uncached_part_is_prefilled_locally():
    loads = {"d1": load("d1"), "p1": load("p1", role="prefill")}
    d = decide({"d1": 120}, loads, decode=["d1"], prefill=["p1"])
    assert d.prefill_worker is None and d.path == "local"
    assert d.prefill_reason == "local: uncached 128 tokens < 256"


def test_long_uncached_part_goes_to_a_prefill_worker():
    loads = {"d1": load("d1"), "p1": load("p1", role="prefill")}
    d = decide({"d1": 10}, loads, decode=["d1"], prefill=["p1"])
    assert d.prefill_worker == "p1" and d.path == "disaggregated"
    assert d.prefill_reason == "disaggregated: uncached 1888 tokens >= 256"


def test_no_healthy_prefill_worker_means_local_prefill():
    d = decide({}, {}, decode=["d1"], prefill=[])
    assert d.prefill_worker is None
    assert d.prefill_reason == "local: no healthy prefill worker"


def test_a_backed_up_prefill_pool_sends_the_prompt_to_the_decode_worker():
    """Conditional disaggregation (router/prefill_placement.py): the prompt goes to the shorter
    of the two prompt backlogs, a tie to the prefill worker."""
    d = decide({"d1": 10}, {"d1": load("d1", waiting_tokens=100), "p1": load("p1", waiting_tokens=101, role="prefill")},
               decode=["d1"], prefill=["p1"])
    assert d.prefill_worker is None and d.path == "local" and d.prefill_cached_blocks == 0
    assert d.prefill_reason == ("local: the prefill worker has 101 prompt tokens queued, the decode worker 100: "
                                "these 1888 finish sooner there")
    d = decide({"d1": 10}, {"d1": load("d1", waiting_tokens=100), "p1": load("p1", waiting_tokens=100, role="prefill")},
               decode=["d1"], prefill=["p1"])
    assert d.prefill_worker == "p1" and d.path == "disaggregated"
    # what this router sent since the last reports counts too
    loads = {"d1": load("d1"), "p1": load("p1", role="prefill")}
    assert decide({}, loads, decode=["d1"], prefill=["p1"], pending_tokens={"p1": 1}).path == "local"
    assert decide({}, loads, decode=["d1"], prefill=["p1"], pending_tokens={"p1": 5, "d1": 5}).path == "disaggregated"


def test_strict_disaggregation_waits_for_the_prefill_worker_whatever_its_queue():
    loads = {"d1": load("d1"), "p1": load("p1", waiting_tokens=50_000, role="prefill")}
    d = decide({}, loads, decode=["d1"], prefill=["p1"], config=PolicyConfig(strict_disaggregation=True))
    assert d.prefill_worker == "p1" and d.prefill_reason == "disaggregated: uncached 2048 tokens >= 256"


def test_prefill_choice_credits_its_cache_against_its_queue():
    loads = {"p1": load("p1", waiting_tokens=1000, role="prefill"),
             "p2": load("p2", waiting_tokens=1500, role="prefill")}
    # p2: 1500 queued + 2048 − 64×16 cached = 2524 < p1: 1000 + 2048 = 3048
    assert choose_prefill(["p1", "p2"], {"p2": 64}, PROMPT, BS, loads, random.Random(0)) == "p2"
    # with only 16 blocks cached p2 costs 3292 and p1 wins
    assert choose_prefill(["p1", "p2"], {"p2": 16}, PROMPT, BS, loads, random.Random(0)) == "p1"
    loads["d1"] = load("d1", waiting_tokens=1500)  # as backed up: the prompt stays disaggregated
    d = decide({"p2": 64}, loads, decode=["d1"], prefill=["p1", "p2"])
    assert (d.prefill_worker, d.prefill_cached_blocks) == ("p2", 64)


def test_prefill_ties_break_by_queue_then_randomly():
    loads = {"p1": load("p1", waiting_tokens=1024, role="prefill"),
             "p2": load("p2", waiting_tokens=0, role="prefill")}
    # p1: 1024 + 2048 − 1024 = 2048 = p2: 0 + 2048 → the emptier queue
    assert choose_prefill(["p1", "p2"], {"p1": 64}, PROMPT, BS, loads, random.Random(0)) == "p2"
    picks = {choose_prefill(["p1", "p2", "p3"], {}, PROMPT, BS, {}, random.Random(s))
             for s in range(50)}
    assert picks == {"p1", "p2", "p3"}


def test_no_decode_worker_is_a_clear_error():
    with pytest.raises(NoHealthyWorker, match="no healthy decode worker"):
        decide({}, {}, decode=[])


def test_decision_explains_itself():
    loads = {"d1": load("d1"), "d2": load("d2", running=8)}
    d = decide({"d1": 120, "p1": 2}, loads, prefill=["p1"])
    assert d.header_value() == "decode=d1; prefill=-; cached=120/128; reason=best-cost"
    fields = d.log_fields()
    assert fields["decode_worker"] == "d1" and fields["prefill_worker"] is None
    assert fields["prompt_blocks"] == 128 and fields["prefill_reason"].startswith("local")
    assert set(fields["costs"]) == {"d1", "d2"}


@pytest.mark.parametrize("kw", [{"overlap_credit": -1}, {"requests_per_load_unit": 0},
                                {"imbalance_ratio": 0.5}, {"disagg_min_uncached_tokens": -1}])
def test_bad_config_is_rejected(kw):
    with pytest.raises(ValueError):
        PolicyConfig(**kw)

