"""Routing by KV tier: a worker's device blocks score above its offloaded (host/disk) blocks,
which score above a miss; the decode worker's tier blocks are not sent to a prefill worker."""

import random

import pytest

from splitserve.cluster.messages import LoadReport
from splitserve.router.policy import PolicyConfig, route
from splitserve.router.radix_index import RadixIndex
from splitserve.router.tier_scoring import prefix_scores, pull_source, reachable_blocks, tier_holder

BS = 16
CHAIN = list(range(100, 110))  # a 10-block prompt's chained hashes


def idle(*workers):
    return {w: LoadReport(w, "decode", 0, 0, 0.0) for w in workers}


def test_prefix_scores_weigh_device_blocks_over_tier_blocks_over_misses():
    matched = {"a": 10, "b": 4, tier_holder("b"): 10, tier_holder("c"): 10}
    scores = prefix_scores(matched, ["a", "b", "c", "d"], tier_credit=0.5)
    assert scores == {"a": 10, "b": 4 + 0.5 * 6, "c": 5.0, "d": 0}
    assert reachable_blocks(matched, "b") == 10 and reachable_blocks(matched, "d") == 0


def test_a_tier_run_shorter_than_the_device_run_adds_nothing():
    assert prefix_scores({"a": 8, tier_holder("a"): 3}, ["a"], tier_credit=0.5) == {"a": 8}


@pytest.mark.parametrize("holders, expected", [
    ({"device": 10, tier_holder("tier"): 10}, "device"),  # device hit beats a tier hit
    ({tier_holder("tier"): 10}, "tier"),  # a tier hit beats a miss
    ({"device": 2, tier_holder("tier"): 10}, "tier"),  # 2 device blocks < 2 + 0.5 * 8 tier-equivalents
])
def test_route_prefers_device_then_tier_then_miss(holders, expected):
    index = RadixIndex()
    for holder, n in holders.items():
        index.apply_stored(holder, None, CHAIN[:n])
    workers = ["device", "miss", "tier"]
    decision = route(len(CHAIN) * BS + 3, BS, index.match(CHAIN), workers, [], idle(*workers),
                     random.Random(0))
    assert decision.decode_worker == expected


def test_tier_credit_zero_ignores_tiers_and_one_equals_device():
    matched = {tier_holder("t"): 10}
    workers = ["m", "t"]
    for seed in range(5):  # a tie: either worker, at random
        assert route(170, BS, matched, workers, [], idle(*workers), random.Random(seed),
                     PolicyConfig(tier_credit=0.0, peer_credit=0.0)).reason.startswith("tie")
    d = route(170, BS, {"d": 10, tier_holder("t"): 10}, ["d", "t"], [], idle("d", "t"), random.Random(0),
              PolicyConfig(tier_credit=1.0))
    assert d.reason.startswith("tie")
    for bad in (dict(tier_credit=1.5), dict(tier_credit=0.2, peer_credit=0.3), dict(peer_pull_min_blocks=0)):
        with pytest.raises(ValueError, match="credit|min_blocks"):
            PolicyConfig(**bad)


def test_decode_worker_tier_blocks_count_as_cached_for_disaggregation():
    """The decode worker loads its tier blocks back: only the rest is worth a prefill worker."""
    matched = {tier_holder("d"): 10}
    decision = route(10 * BS + 8, BS, matched, ["d"], ["p"], idle("d"), random.Random(0),
                     PolicyConfig(disagg_min_uncached_tokens=64))
    assert decision.decode_cached_blocks == 10
    assert decision.prefill_worker is None and "uncached 8 tokens" in decision.prefill_reason


def test_a_block_a_peer_holds_scores_above_a_miss_and_below_a_tier_block():
    matched = {"holder": 10, tier_holder("tiered"): 10}
    scores = prefix_scores(matched, ["holder", "tiered", "lacking"], tier_credit=0.5, peer_credit=0.25)
    assert scores == {"holder": 10, "tiered": 5.0, "lacking": 2.5}
    assert prefix_scores(matched, ["holder", "lacking"], 0.5, peer_credit=0.0)["lacking"] == 0


@pytest.mark.parametrize("matched, chosen, expected", [
    ({"a": 10}, "b", ("a", 10)),  # b lacks what a holds on device
    ({tier_holder("a"): 10}, "b", ("a", 10)),  # ... or in a tier: a loads it back, then pushes
    ({"a": 10, tier_holder("c"): 10}, "b", ("a", 10)),  # equal reach: the device holder
    ({"a": 10, "b": 8}, "b", None),  # 2 more blocks < min 4: recompute them
    ({"a": 10}, "a", None),  # the chosen worker holds it
    ({}, "b", None),  # nobody does
])
def test_pull_source_names_the_peer_holding_the_most_more_than_the_minimum(matched, chosen, expected):
    assert pull_source(matched, chosen, ["a", "b", "c"], min_blocks=4) == expected


def test_round_robin_choice_without_the_prefix_gets_a_pull_hint():
    """The decode worker is forced (round robin): the decision names the peer to pull from,
    and the rest of the prompt is too short to be worth a prefill worker."""
    matched = {"a": 10}
    d = route(10 * BS + 8, BS, matched, ["b"], ["p"], idle("a", "b"), random.Random(0),
              PolicyConfig(disagg_min_uncached_tokens=64), peers=["a", "b"])
    assert (d.decode_worker, d.pull_worker, d.pull_blocks) == ("b", "a", 10)
    assert d.decode_cached_blocks == 0 and d.prefill_worker is None
    assert "pull=a:10" in d.header_value()


def test_a_load_balancing_choice_keeps_the_cached_prefix_by_pulling_it():
    """The imbalance guard sends the request away from the worker holding the prefix; the
    decision then names that worker to pull from instead of recomputing."""
    loads = {"a": LoadReport("a", "decode", 40, 8, 0.5), "b": LoadReport("b", "decode", 0, 1, 0.0)}
    d = route(10 * BS + 3, BS, {"a": 10}, ["a", "b"], [], loads, random.Random(0))
    assert d.decode_worker == "b" and d.reason.startswith("imbalance-guard")
    assert (d.pull_worker, d.pull_blocks) == ("a", 10)
