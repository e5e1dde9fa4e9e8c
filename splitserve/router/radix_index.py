"""The router's radix index: which worker holds which KV block.

Block hashes are chained (h[i] depends on h[i-1], see core/hashing.py), so a hash
names a whole prefix and a node is found by hash directly: the tree is a dict
hash -> holders plus parent links. The links matter only for pruning (evict leaves,
never the middle of a prefix whose continuation is still cached) and for the LRU order.

Layout, chosen for the routing hot path and for a million-node index:
- workers are small integers (slots) and a node's holders a bitmask, so matching a
  prompt is one dict lookup and one `&` per block;
- nodes are not objects but entries in int-only dicts (mask, parent, children count,
  approximate bits): no per-node allocation, nothing for the garbage collector to walk;
- recency is the order of the mask OrderedDict rather than a timestamp: a touch moves
  a path to the end leaf first, so a node normally sits after its descendants and the
  front is the least-recently-touched leaf. Eviction gives a front node that still has
  children a second chance (moves it to the end), so it never cuts a chain in the
  middle; each node is skipped at most once per pass, so eviction stays O(1) amortized.

Two kinds of entries: precise (from the worker's own KV events) and approximate (the
router's own routing decisions, `record_routed`, which expire after a TTL). A precise
entry wins over an approximate one for the same (block, worker).
(Over 300 lines on purpose: the int-dict layout above is shared by lookup, apply and
eviction, which must change together; one file keeps that layout in one view.)
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

# Rough bytes per node and per (node, worker) entry on CPython 3.11, for sizing
# `max_blocks`: `splitserve bench router` measured ~400 MB RSS for 1M nodes holding
# 2.7M entries.
NODE_BYTES = 290
ENTRY_BYTES = 40
MAX_PENDING_TOUCHES = 4096


class RadixIndex:
    def __init__(self, max_blocks: int = 1_000_000, clock: Callable[[], float] = time.monotonic):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._clock = clock
        self._mask: OrderedDict[int, int] = OrderedDict()  # hash -> holder bits; LRU order
        self._parent: dict[int, int] = {}  # hash -> parent hash (roots are absent)
        self._children: dict[int, int] = {}  # hash -> linked children (absent when 0)
        self._approx: dict[int, int] = {}  # hash -> bits held only approximately
        self._slot_of: dict[str, int] = {}
        self._worker_of: dict[int, str] = {}
        self._worker_of_bit: dict[int, str] = {}  # 1 << slot -> worker (hot path)
        self._free_slots: list[int] = []
        # worker -> hashes it holds (any kind); dicts of ints rather than sets because
        # CPython's collector skips them (a full GC pass over millions of set entries
        # stalls the router for a good fraction of a second)
        self._held: dict[str, dict[int, None]] = {}
        # (expires_at, hash, slot); stale heap items are skipped when popped
        self._expiry_heap: list[tuple[float, int, int]] = []
        self._approx_expiry: dict[tuple[int, int], float] = {}
        self._pending_touch: dict[int, Sequence[int]] = {}  # last hash -> matched path
        self.pruned_blocks = 0  # nodes evicted by the memory bound, since creation

    # ---- sizes ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._mask)

    @property
    def num_entries(self) -> int:
        return sum(len(s) for s in self._held.values())

    def blocks_of(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def workers(self) -> list[str]:
        return sorted(self._slot_of)

    def approx_bytes(self) -> int:
        return self.num_blocks * NODE_BYTES + self.num_entries * ENTRY_BYTES

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._mask

    # ---- worker slots -----------------------------------------------------------------
    def _slot(self, worker_id: str) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[worker_id] = slot
            self._worker_of[slot] = worker_id
            self._worker_of_bit[1 << slot] = worker_id
            self._held[worker_id] = {}
        return slot

    def _add_node(self, h: int, parent: int | None) -> None:
        # Link only to a parent that already exists: links then always point to older
        # nodes, so even malformed events cannot make a cycle.
        if parent is not None and parent in self._mask:
            self._parent[h] = parent
            self._children[parent] = self._children.get(parent, 0) + 1
        self._mask[h] = 0

    # ---- updates from KV events (precise mode) ----------------------------------------
    def apply_stored(self, worker_id: str, parent_hash: int | None, hashes: Sequence[int]) -> None:
        """`worker_id` cached the chain `hashes`, which continues the block `parent_hash`."""
        if not hashes:
            return
        if self._pending_touch:
            self.flush_touches()
        slot = self._slot(worker_id)
        bit = 1 << slot
        masks, approx, held = self._mask, self._approx, self._held[worker_id]
        parent = parent_hash
        for h in hashes:
            if h not in masks:
                self._add_node(h, parent)
            masks[h] |= bit
            if approx.get(h, 0) & bit:  # now known precisely: it no longer expires
                self._clear_approx(h, slot)
            held[h] = None
            parent = h
        self._touch(hashes)
        self._enforce_bound()

    def apply_removed(self, worker_id: str, hashes: Iterable[int]) -> None:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        held = self._held[worker_id]
        for h in hashes:
            if held.pop(h, 0) is None:
                self._drop_bit(h, slot)

    def clear_worker(self, worker_id: str) -> None:
        """Forget every block of `worker_id` but keep its slot (resync, `cleared` event)."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        held = self._held[worker_id]
        for h in held:
            self._drop_bit(h, slot)
        held.clear()

    def remove_worker(self, worker_id: str) -> None:
        """`worker_id` left the cluster: forget its blocks and free its slot."""
        if worker_id not in self._slot_of:
            return
        self.clear_worker(worker_id)
        slot = self._slot_of.pop(worker_id)
        del self._worker_of[slot], self._worker_of_bit[1 << slot], self._held[worker_id]
        self._free_slots.append(slot)

    def _clear_approx(self, h: int, slot: int) -> None:
        bits = self._approx[h] & ~(1 << slot)
        if bits:
            self._approx[h] = bits
        else:
            del self._approx[h]
        self._approx_expiry.pop((h, slot), None)

    def _drop_bit(self, h: int, slot: int) -> None:
        """Remove one holder; the caller has already updated `_held`."""
        mask = self._mask.get(h)
        if mask is None:
            return
        mask &= ~(1 << slot)
        self._mask[h] = mask
        if self._approx.get(h, 0) >> slot & 1:
            self._clear_approx(h, slot)
        if not mask and h not in self._children:
            self._delete_chain(h)

    def _delete_chain(self, h: int) -> int:
        """Delete the leaf `h` (with whatever workers still hold it), then its ancestors
        that became empty leaves. Returns the number of nodes deleted."""
        deleted = 0
        while True:
            mask = self._mask.pop(h)
            deleted += 1
            for slot in _bits(mask):  # non-empty only when pruned for memory
                self._held[self._worker_of[slot]].pop(h, None)
                if self._approx.get(h, 0) >> slot & 1:
                    self._clear_approx(h, slot)
            parent = self._parent.pop(h, None)
            if parent is None:
                return deleted
            left = self._children[parent] - 1  # a linked parent is never deleted first
            if left:
                self._children[parent] = left
                return deleted
            del self._children[parent]
            if self._mask[parent]:
                return deleted
            h = parent

    # ---- approximate mode -------------------------------------------------------------
    def record_routed(self, worker_id: str, hashes: Sequence[int], ttl: float) -> None:
        """The router sent `hashes` to `worker_id`, which publishes no KV events: assume
        it caches them for `ttl` seconds (each new decision refreshes the TTL)."""
        if not hashes:
            return
        if self._pending_touch:
            self.flush_touches()
        slot = self._slot(worker_id)
        bit = 1 << slot
        expires = self._clock() + ttl
        masks, approx, held = self._mask, self._approx, self._held[worker_id]
        parent = None
        for h in hashes:
            if h not in masks:
                self._add_node(h, parent)
            parent = h
            if masks[h] & bit and not approx.get(h, 0) & bit:
                continue  # already held precisely
            masks[h] |= bit
            approx[h] = approx.get(h, 0) | bit
            held[h] = None
            self._approx_expiry[(h, slot)] = expires
            heapq.heappush(self._expiry_heap, (expires, h, slot))
        self._touch(hashes)
        self._enforce_bound()

    def expire(self, now: float | None = None) -> int:
        """Drop approximate entries whose TTL passed; returns how many."""
        heap = self._expiry_heap
        now = self._clock() if now is None else now
        dropped = 0
        while heap and heap[0][0] <= now:
            expires, h, slot = heapq.heappop(heap)
            if self._approx_expiry.get((h, slot)) != expires:
                continue  # refreshed, turned precise, or already gone
            self._held[self._worker_of[slot]].pop(h, None)
            self._drop_bit(h, slot)
            dropped += 1
        return dropped

    # ---- lookup -------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], touch: bool = True) -> dict[str, int]:
        """For every worker holding the prompt's first block: how many leading blocks of
        `hashes` it holds. `touch` marks the matched prefix recently used."""
        if self._expiry_heap and self._expiry_heap[0][0] <= self._clock():
            self.expire()
        result: dict[str, int] = {}
        worker_of_bit = self._worker_of_bit
        active = -1  # workers holding every block so far
        depth = 0
        for mask in map(self._mask.get, hashes):  # the lookups run in C
            mask = mask & active if mask is not None else 0
            if mask != active:
                ended = active & ~mask if depth else 0  # these workers' prefixes end here
                while ended:
                    low = ended & -ended
                    result[worker_of_bit[low]] = depth
                    ended ^= low
                if not mask:
                    break
                active = mask
            depth += 1
        else:
            while depth and active:
                low = active & -active
                result[worker_of_bit[low]] = depth
                active ^= low
        if touch and depth:
            # Recency only matters when something is evicted, so the touch is queued and
            # applied before the next update or by `flush_touches` (IndexSync calls it
            # each poll): the decision path stays short, and a prefix matched many times
            # between two flushes is touched once.
            # A full queue (no updates for a while) makes this one touch now instead.
            pending = self._pending_touch
            last = hashes[depth - 1]
            if pending.pop(last, None) is None and len(pending) >= MAX_PENDING_TOUCHES:
                self._touch(hashes[:depth])
            else:
                pending[last] = hashes[:depth]
        return result

    def flush_touches(self) -> None:
        """Apply queued touches in the order the matches happened."""
        pending, self._pending_touch = self._pending_touch, {}
        masks = self._mask
        for path in pending.values():
            try:
                self._touch(path)
            except KeyError:  # part of the path was removed since the match
                alive = [h for h in path if h in masks]
                if alive:
                    self._touch(alive)

    def _touch(self, path: Sequence[int]) -> None:
        """Mark a root-first chain most recently used, leaf first. Ancestors above the
        chain are not walked (that would make incremental decode events quadratic);
        eviction's second chance covers them."""
        deque(map(self._mask.move_to_end, reversed(path)), maxlen=0)

    def _enforce_bound(self) -> None:
        masks = self._mask
        while len(masks) > self.max_blocks:
            h = next(iter(masks))
            if h in self._children:  # never cut a cached chain in the middle
                masks.move_to_end(h)
                continue
            self.pruned_blocks += self._delete_chain(h)

    # ---- inspection (tests, debugging) ------------------------------------------------
    def snapshot(self) -> dict[int, frozenset[str]]:
        """hash -> workers holding it; equal snapshots give equal routing answers."""
        return {h: frozenset(self._worker_of[s] for s in _bits(m))
                for h, m in self._mask.items() if m}


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
