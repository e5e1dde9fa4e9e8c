"""The router's radix index against hand-worked cases and a naive model."""

import random

import pytest

from splitserve.core.hashing import block_hashes, hash_seed
from splitserve.router.radix_index import RadixIndex, _bits


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def chain(tokens, seed=hash_seed("m")):
    return block_hashes(tokens, block_size=4, seed=seed)


def check_invariants(idx: RadixIndex) -> None:
    """Internal consistency: links point at live nodes, child counts are right, the
    per-worker sets mirror the masks, and no node is empty without children."""
    counts: dict[int, int] = {}
    for h, parent in idx._parent.items():
        assert h in idx._mask and parent in idx._mask
        counts[parent] = counts.get(parent, 0) + 1
    assert counts == idx._children
    held_from_masks: dict[str, set[int]] = {w: set() for w in idx._held}
    for h, mask in idx._mask.items():
        assert mask or h in idx._children, "empty leaf left behind"
        for slot in _bits(mask):
            held_from_masks[idx._worker_of[slot]].add(h)
        assert idx._approx.get(h, 0) & ~mask == 0
    assert held_from_masks == {w: set(d) for w, d in idx._held.items()}
    for (h, slot), _ in idx._approx_expiry.items():
        assert idx._approx[h] >> slot & 1


A = list(range(0, 16))  # 4 blocks of 4 tokens
B = A[:8] + [99, 98, 97, 96]  # shares 2 blocks with A, then diverges


def test_match_returns_leading_blocks_per_worker():
    idx = RadixIndex()
    ha, hb = chain(A), chain(B)
    idx.apply_stored("w1", None, ha)
    idx.apply_stored("w2", None, ha[:2])
    idx.apply_stored("w3", None, hb)
    assert idx.match(ha) == {"w1": 4, "w2": 2, "w3": 2}
    assert idx.match(hb) == {"w1": 2, "w2": 2, "w3": 3}
    assert idx.match(ha + chain(A + [1, 2, 3, 4])[4:]) == {"w1": 4, "w2": 2, "w3": 2}
    assert idx.match(chain([5] * 8)) == {}
    assert idx.match([]) == {}
    assert idx.num_blocks == 5 and idx.num_entries == 4 + 2 + 3
    check_invariants(idx)


def test_a_hole_in_a_workers_chain_ends_its_prefix():
    idx = RadixIndex()
    h = chain(A)
    idx.apply_stored("w1", None, h)
    idx.apply_stored("w2", None, h)
    idx.apply_removed("w2", [h[1]])
    assert idx.match(h) == {"w1": 4, "w2": 1}
    idx.apply_removed("w1", [h[0]])  # w1 lost its first block: no usable prefix at all
    assert idx.match(h) == {"w2": 1}
    assert h[0] in idx  # still a linked parent of cached blocks
    check_invariants(idx)


def test_removed_leaves_are_deleted_up_the_chain():
    idx = RadixIndex()
    h = chain(A)
    idx.apply_stored("w1", None, h)
    idx.apply_removed("w1", [h[3], h[2]])
    assert h[3] not in idx and h[2] not in idx and idx.num_blocks == 2
    idx.apply_removed("w1", h[:2])
    assert idx.num_blocks == 0 and idx.match(h) == {}
    check_invariants(idx)


def test_clear_and_remove_worker_free_everything_and_slots_are_reused():
    idx = RadixIndex()
    h = chain(A)
    idx.apply_stored("w1", None, h)
    idx.apply_stored("w2", None, h[:3])
    idx.clear_worker("w1")
    assert idx.match(h) == {"w2": 3} and idx.blocks_of("w1") == 0
    assert idx.workers() == ["w1", "w2"]
    idx.remove_worker("w2")
    assert idx.num_blocks == 0 and idx.workers() == ["w1"]
    idx.apply_stored("w3", None, h[:1])  # takes w2's freed slot; no stale bits
    assert idx.match(h) == {"w3": 1}
    check_invariants(idx)


def test_stored_event_continuing_a_parent_links_into_the_tree():
    idx = RadixIndex()
    h = chain(A)
    idx.apply_stored("w1", None, h[:2])
    idx.apply_stored("w1", h[1], h[2:])  # decode worker publishing as it generates
    assert idx._parent[h[2]] == h[1]
    assert idx.match(h) == {"w1": 4}
    check_invariants(idx)


def test_approximate_entries_expire_and_precise_events_win():
    clock = FakeClock()
    idx = RadixIndex(clock=clock)
    h = chain(A)
    idx.record_routed("w1", h, ttl=10)
    idx.record_routed("w2", h[:2], ttl=10)
    assert idx.match(h) == {"w1": 4, "w2": 2}
    clock.now += 5
    idx.record_routed("w1", h[:2], ttl=10)  # refresh the first two blocks only
    idx.apply_stored("w2", None, h[:1])  # w2 turns precise for block 0
    clock.now += 6  # original TTLs passed; the refreshed ones not
    assert idx.match(h) == {"w1": 2, "w2": 1}
    check_invariants(idx)
    clock.now += 10
    assert idx.match(h) == {"w2": 1}
    assert idx.num_blocks == 1
    check_invariants(idx)


def test_memory_bound_prunes_least_recently_touched_leaves():
    idx = RadixIndex(max_blocks=8)
    hot, cold = chain(A), chain(B)
    idx.apply_stored("w1", None, hot)  # 4 nodes
    idx.apply_stored("w2", None, cold)  # shares 2: 5 nodes in all
    idx.match(hot)  # hot is the most recent now
    idx.apply_stored("w3", None, chain([7] * 16))  # 4 more: 9 > 8, one leaf must go
    assert idx.num_blocks == 8 and idx.pruned_blocks == 1
    assert cold[2] not in idx  # the cold branch's leaf, not the shared middle
    assert idx.match(hot) == {"w1": 4, "w2": 2}
    check_invariants(idx)


def test_queued_touches_survive_removals_and_keep_match_order():
    idx = RadixIndex(max_blocks=9)
    a, b = chain(A), chain(B)  # b shares a's first two blocks, then has one of its own
    idx.apply_stored("w1", None, a)
    idx.apply_stored("w1", None, b)  # 5 nodes; a's leaf is now older than b's
    idx.apply_removed("w1", [a[3]])  # a[2] becomes a leaf, still older than b[2]
    idx.match(a)  # queued touch of a path whose last block is gone
    idx.match(a[:3])  # a again: now a[2] is more recent than b[2]
    idx.apply_stored("w2", None, chain([7] * 16))  # flushes the touches first; 8 nodes
    idx.apply_stored("w2", None, chain([8] * 8))  # 10 > 9: the oldest leaf goes
    assert b[2] not in idx and a[2] in idx  # without the touches a[2] would have gone
    assert idx.match(a) == {"w1": 3}
    check_invariants(idx)


def test_bound_never_cuts_a_chain_in_the_middle():
    idx = RadixIndex(max_blocks=50)
    rng = random.Random(1)
    for _ in range(30):
        tokens = [rng.randrange(5) for _ in range(40)]
        h = chain(tokens)
        # published one block at a time, as a decode worker does while generating
        for i, x in enumerate(h):
            idx.apply_stored(f"w{rng.randrange(3)}", h[i - 1] if i else None, [x])
            idx.match(h[: rng.randrange(1, i + 2)])  # queued touches interleave with updates
        check_invariants(idx)
        assert idx.num_blocks <= 50


def test_malformed_events_cannot_make_a_cycle():
    idx = RadixIndex()
    idx.apply_stored("w1", None, [1, 2])
    idx.apply_stored("w1", 2, [1])  # claims 1 follows 2: ignored as a link
    idx.apply_stored("w1", 7, [7, 7, 8])  # self-parent and repeats
    assert idx.match([1, 2]) == {"w1": 2}
    assert idx.match([7, 7, 8]) == {"w1": 3}
    check_invariants(idx)
    idx.clear_worker("w1")  # deleting must terminate and leave nothing behind
    assert idx.num_blocks == 0 and idx._parent == {} and idx._children == {}


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_agree_with_a_naive_model(seed):
    rng = random.Random(seed)
    clock = FakeClock()
    idx = RadixIndex(clock=clock)
    model: dict[str, set[int]] = {}  # worker -> hashes (precise only in this test)
    prompts = [chain([rng.randrange(3) for _ in range(24)]) for _ in range(12)]
    workers = [f"w{i}" for i in range(5)]
    for _ in range(400):
        op = rng.random()
        w = rng.choice(workers)
        p = rng.choice(prompts)
        if op < 0.5:
            k = rng.randrange(len(p) + 1)
            idx.apply_stored(w, None, p[:k])
            model.setdefault(w, set()).update(p[:k])
        elif op < 0.8:
            gone = rng.sample(p, rng.randrange(3))
            idx.apply_removed(w, gone)
            model.get(w, set()).difference_update(gone)
        elif op < 0.9:
            idx.clear_worker(w)
            model.pop(w, None)
        else:
            idx.remove_worker(w)
            model.pop(w, None)
        q = rng.choice(prompts)
        expected = {}
        for worker, held in model.items():
            n = 0
            while n < len(q) and q[n] in held:
                n += 1
            if n:
                expected[worker] = n
        assert idx.match(q) == expected
    check_invariants(idx)


def test_bad_bound_is_rejected():
    with pytest.raises(ValueError, match="max_blocks"):
        RadixIndex(max_blocks=0)
