"""Paged KV block allocation with prefix reuse.

Blocks are ref-counted. A full, computed block is published under its chained
hash (splitserve/engine/hashing.py, the router's hash space), so a later request
with the same prefix takes it instead of recomputing. A block whose last user
leaves stays cached on the free list; the free list is in LRU order, so the
blocks reused first are the ones idle longest (eviction). Every publish and
eviction is recorded as a KV event for the router's index.
"""

from __future__ import annotations

from collections import OrderedDict

from splitserve.core.block_events import BlockEvent
from splitserve.core.hashing import block_hashes
from splitserve.engine.kv_offload.load_back import load_from_tiers
from splitserve.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, hash_seed: int = 0, enable_prefix_caching: bool = True,
                 offload=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks, least recently used first. Cached blocks stay here until reused.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.events: list[BlockEvent] = []
        self.offload = offload  # KVOffloader (engine/kv_offload/): host and disk tiers under this pool, or None

    # ---- low-level: raw blocks (KV transfer leases use these) --------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def allocate_blocks(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self.free)} free of {self.num_blocks}")
        return [self._take_free() for _ in range(n)]

    def release_blocks(self, block_ids: list[int]) -> None:
        # Tail blocks first, so a sequence's head (the most shareable prefix) is evicted last.
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] < 0:
                raise AssertionError(f"KV block {b} released more often than taken")
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:  # nothing to reuse: hand it out first
                    self.free.move_to_end(b, last=False)
                elif self.offload is not None:  # idle and cached: written down in the background
                    self.offload.on_cached_free(b, self.block_hash[b])

    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        if self.offload is not None:  # its pending write-down happens now or never
            self.offload.before_reuse(b)
        h = self.block_hash[b]
        if h is not None:  # evict its cached content
            self.block_hash[b] = None
            if self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
                self._removed(h)
        self.ref_counts[b] = 1
        return b

    def _removed(self, h: int) -> None:
        """One event for a run of evictions (a prompt taking 18 blocks evicts 18): each event
        is a message to every router, and order is kept, as only adjacent ones merge."""
        if self.events and self.events[-1].kind == "removed":
            self.events[-1].block_hashes.append(h)
        else:
            self.events.append(BlockEvent("removed", [h]))

    def _take_cached(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            del self.free[b]
        self.ref_counts[b] += 1

    # ---- sequences ------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the sequence's leading tokens. The last token is always
        recomputed (its logits are needed), so at most (num_tokens - 1) tokens match."""
        if not self.enable_prefix_caching:
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        self.ensure_hashes(seq, usable)
        hits = []
        for h in seq.block_hashes[:usable]:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            hits.append(b)
        if self.offload is not None and len(hits) < usable:  # the rest may be in the host or disk tier
            hits += load_from_tiers(self, seq, hits, usable)
        return hits

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        fresh_needed = -(-(len(cached) * self.block_size + num_new_tokens) // self.block_size) - len(cached)
        reusable_free = sum(1 for b in cached if self.ref_counts[b] == 0)
        return fresh_needed <= len(self.free) - reusable_free

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give a waiting sequence its cached prefix blocks (it then computes the rest)."""
        for b in cached:
            self._take_cached(b)
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_registered_blocks = len(cached)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Allocate the blocks `num_new_tokens` more tokens will be written to."""
        seq.block_table.extend(self.allocate_blocks(self.blocks_needed(seq, num_new_tokens)))

    def free_sequence(self, seq: Sequence) -> None:
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def publish_full_blocks(self, seq: Sequence) -> None:
        """After a step: register blocks that are now full and computed under their hash."""
        if not self.enable_prefix_caching:
            return
        # (computed drafts are not the sequence's tokens until accepted: engine/spec/)
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full <= seq.num_registered_blocks:
            return
        self.ensure_hashes(seq, full)
        start = seq.num_registered_blocks
        for i in range(start, full):
            h, b = seq.block_hashes[i], seq.block_table[i]
            if h not in self.hash_to_block:  # a twin computed concurrently keeps the entry
                self.hash_to_block[h] = b
                self.block_hash[b] = h
        seq.num_registered_blocks = full
        # The whole new chain segment: the router adds (worker, hash) idempotently.
        parent = seq.block_hashes[start - 1] if start > 0 else None
        self.events.append(BlockEvent("stored", seq.block_hashes[start:full], parent))

    def ensure_hashes(self, seq: Sequence, n_blocks: int) -> None:
        have = len(seq.block_hashes)
        if have >= n_blocks:
            return
        parent = seq.block_hashes[-1] if have else None
        seq.block_hashes.extend(block_hashes(seq.token_ids[: n_blocks * self.block_size], self.block_size,
                                             seed=self.hash_seed ^ seq.hash_salt, start_parent=parent,
                                             start_block=have))

    def drain_events(self) -> list[BlockEvent]:
        if self.offload is not None:  # blocks the disk tier lost (its directory was deleted): again
            for h in self.offload.take_rewrites():
                b = self.hash_to_block.get(h)
                if b is not None and self.ref_counts[b] == 0:
                    self.offload.on_cached_free(b, h)
        events, self.events = self.events, []
        return events + (self.offload.drain_events() if self.offload is not None else [])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no running sequence holds (and the offload tiers)."""
        if self.offload is not None:
            self.offload.clear()
        for b in list(self.free):
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                    self._removed(h)
