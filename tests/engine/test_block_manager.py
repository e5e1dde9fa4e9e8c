"""Ref-counted blocks, prefix reuse by chained hash, LRU eviction, KV events."""

import pytest

from splitserve.core.hashing import block_hashes
from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.block_manager import BlockManager, NoFreeBlocksError
from splitserve.engine.sequence import Sequence

BS = 4


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), 1000)


def run_prefill(bm, s):
    """Admit with whatever is cached, compute the rest, publish: as the engine does."""
    cached = bm.match_prefix(s)
    bm.admit(s, cached)
    n = s.num_tokens - s.num_computed_tokens
    bm.grow(s, n)
    s.num_computed_tokens += n
    bm.publish_full_blocks(s)
    return len(cached)


def test_shared_prefix_reuses_blocks_and_refcounts():
    bm = BlockManager(16, BS)
    a = seq(range(10), "a")  # 2 full blocks + 2 tokens
    assert run_prefill(bm, a) == 0
    b = seq(list(range(8)) + [99, 98, 97], "b")
    assert run_prefill(bm, b) == 2
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.ref_count(a.block_table[0]) == 2
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 16


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(16, BS)
    a = seq(range(8))  # exactly 2 blocks
    run_prefill(bm, a)
    a_table = list(a.block_table)
    bm.free_sequence(a)
    again = seq(range(8))
    cached = bm.match_prefix(again)
    assert cached == a_table[:1]  # block 2 holds the last token: its logits are needed
    bm.admit(again, cached)
    assert again.num_computed_tokens == BS  # the last block's 4 tokens are computed again...
    bm.grow(again, 8 - BS)
    assert again.block_table[1] not in a_table  # ...into a fresh block (a's stays cached, idle)
    bm.free_sequence(again)


def test_lru_eviction_keeps_recently_used_prefixes():
    bm = BlockManager(4, BS)
    old = seq(range(100, 105), "old")  # 1 full block cached
    run_prefill(bm, old)
    bm.free_sequence(old)
    new = seq(range(200, 205), "new")
    run_prefill(bm, new)
    bm.free_sequence(new)
    bm.drain_events()
    # Need 3 blocks: unhashed free blocks go first, then the least recently used cached one.
    taken = bm.allocate_blocks(3)
    events = bm.drain_events()
    assert [e.kind for e in events] == ["removed"]
    assert events[0].block_hashes == block_hashes(range(100, 104), BS)
    assert bm.match_prefix(seq(range(200, 205))) != []  # the recent prefix survived
    bm.release_blocks(taken)


def test_a_run_of_evictions_is_one_removed_event_and_order_is_kept():
    """Each event is a message to every router: a prompt that evicts 18 blocks sends one."""
    bm = BlockManager(6, BS)
    cached = []
    for i in range(3):  # three 1-block prefixes cached, oldest first
        s = seq(range(100 * i, 100 * i + 5), f"c{i}")
        run_prefill(bm, s)
        bm.free_sequence(s)
        cached.append(block_hashes(range(100 * i, 100 * i + 4), BS)[0])
    bm.drain_events()
    taken = bm.allocate_blocks(4)  # the 3 unhashed blocks, then evicts the oldest prefix
    new = seq(range(900, 905), "new")
    run_prefill(bm, new)  # evicts the other two, then stores its block
    bm.free_sequence(new)
    again = bm.allocate_blocks(2)  # its partial block, then evicts its stored one
    stored = block_hashes(range(900, 904), BS)
    assert [(e.kind, e.block_hashes) for e in bm.drain_events()] == [
        ("removed", cached), ("stored", stored), ("removed", stored)]  # merged only where adjacent
    bm.release_blocks(taken + again)


def test_events_describe_stored_chains_with_parents():
    bm = BlockManager(16, BS, hash_seed=7)
    s = seq(range(9))
    run_prefill(bm, s)
    hashes = block_hashes(range(9), BS, seed=7)
    assert [(e.kind, e.block_hashes, e.parent) for e in bm.drain_events()] == [("stored", hashes, None)]
    # decode fills block 3: one more stored event whose parent is block 2
    s.token_ids += [9, 10, 11]
    bm.grow(s, 3)
    s.num_computed_tokens += 3
    bm.publish_full_blocks(s)
    (event,) = bm.drain_events()
    assert event.parent == hashes[-1] and event.block_hashes == block_hashes(range(12), BS, seed=7)[2:]


def test_allocation_beyond_capacity_raises_and_double_release_is_caught():
    bm = BlockManager(2, BS)
    ids = bm.allocate_blocks(2)
    with pytest.raises(NoFreeBlocksError, match="need 1 KV blocks, 0 free of 2"):
        bm.allocate_blocks(1)
    bm.release_blocks(ids)
    with pytest.raises(AssertionError):
        bm.release_blocks(ids[:1])


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(range(9))
    run_prefill(bm, a)
    assert bm.match_prefix(seq(range(9))) == []
    assert bm.drain_events() == []


# ---- the peer prefix pull's transitions (engine/peer_prefix.py calls these) -------------
def test_a_pull_reserves_behind_the_cached_part_and_adopts_with_one_stored_event():
    bm = BlockManager(6, BS)
    a = seq(range(9), "a")  # blocks 0, 1 cached (block 2 holds the last token)
    run_prefill(bm, a)
    a_table = list(a.block_table)
    bm.free_sequence(a)
    bm.drain_events()
    want = seq(range(17), "want")  # 4 whole blocks wanted: 2 cached here, 2 to pull
    cached = bm.match_prefix(want)
    assert cached == a_table[:2]
    assert bm.allocate_behind(cached, 5) is None  # 6 free, 2 of them the cached part: 4 to spare
    ids = bm.allocate_behind(cached, 2)
    assert len(ids) == 2 and not set(ids) & set(cached)
    assert bm.match_prefix(want) == cached  # nothing cached was evicted for them
    hashes = block_hashes(range(16), BS)
    bm.adopt(ids, hashes[2:4], hashes[1])
    assert [(e.kind, e.block_hashes, e.parent) for e in bm.drain_events()] == [("stored", hashes[2:4], hashes[1])]
    assert bm.match_prefix(want) == cached + ids and bm.num_free_blocks == 6  # cached and idle


def test_a_pinned_prefix_outlives_every_allocation_until_released():
    bm = BlockManager(4, BS)
    a = seq(range(9), "a")
    run_prefill(bm, a)
    bm.free_sequence(a)
    pinned = bm.match_prefix(seq(range(9)))
    bm.pin(pinned)
    assert bm.num_free_blocks == 2
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_blocks(3)
    taken = bm.allocate_blocks(2)
    assert bm.match_prefix(seq(range(9))) == pinned
    bm.release_blocks(pinned + taken)
    assert bm.num_free_blocks == 4


# ---- load-back from an offload tier (the offloader's side is tests/engine/test_kv_offload_*) ----
class FakeTiers:
    """Holds blocks by hash; `lose` makes a load fail as a damaged file does."""

    def __init__(self, hashes, lose=()):
        self.held, self.lose, self.loaded, self.reused = list(hashes), set(lose), [], []

    def match(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n

    def load(self, h, b):
        self.loaded.append((h, b))
        return h not in self.lose

    def before_reuse(self, b):
        self.reused.append(b)

    def on_cached_free(self, b, h):
        pass

    def take_rewrites(self):
        return []

    def drain_events(self):
        return []


@pytest.mark.parametrize("num_blocks, loads", [(4, 3), (3, 2)])  # (3: capped by the blocks before the hit)
def test_load_back_extends_device_hits_without_evicting_them_and_publishes_once(num_blocks, loads):
    hashes = block_hashes(range(16), BS)
    tiers = FakeTiers(hashes[1:4])
    bm = BlockManager(num_blocks, BS, offload=tiers)
    a = seq(range(5), "a")  # block 0 cached on the device
    run_prefill(bm, a)
    device_hit = a.block_table[0]
    bm.free_sequence(a)
    bm.drain_events()
    tiers.reused.clear()
    hits = bm.match_prefix(seq(range(17)))  # 4 usable blocks: 1 on the device, 3 in the tiers
    assert hits[0] == device_hit and device_hit not in tiers.reused
    assert tiers.loaded == list(zip(hashes[1:1 + loads], hits[1:], strict=True))
    assert [(e.kind, e.block_hashes, e.parent) for e in bm.drain_events()] == [
        ("stored", hashes[1:1 + loads], hashes[0])]
    assert bm.num_free_blocks == num_blocks and all(bm.ref_count(b) == 0 for b in hits)  # cached, idle
    assert bm.match_prefix(seq(range(17))) == hits and len(tiers.loaded) == loads  # device hits now


def test_a_failed_load_back_ends_the_hit_and_leaves_the_block_plain():
    hashes = block_hashes(range(16), BS)
    tiers = FakeTiers(hashes[:3], lose=[hashes[1]])
    bm = BlockManager(4, BS, offload=tiers)
    hits = bm.match_prefix(seq(range(13)))
    assert len(hits) == 1 and [h for h, _ in tiers.loaded] == hashes[:2]
    assert [(e.kind, e.block_hashes) for e in bm.drain_events()] == [("stored", hashes[:1])]
    assert bm.cached_hashes() == hashes[:1]
    failed = tiers.loaded[1][1]
    assert bm.allocate_blocks(1) == [failed]  # held nothing: handed out first
