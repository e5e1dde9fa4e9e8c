"""The KV cache manager: the one owner of KV block state.

Blocks are ref-counted. A full, computed block is published under its chained hash
(core/hashing.py, the router's hash space), so a later request with the same prefix takes
it instead of recomputing. A block whose last user leaves stays cached on the free list,
which is in LRU order: the blocks reused first are the ones idle longest (eviction).

Every transition of a block is a method here, and nothing else touches the state:
  allocate / release     raw blocks (KV transfer leases, the draft pool) and a sequence's
                         table (admit, grow, shrink, free_sequence)
  publish                a full block joins the prefix cache: `_publish`, the one path that
                         emits a "stored" event (computed here, loaded back, pulled from a peer)
  evict                  `_take_free` reuses an idle cached block: its pending write-down is
                         fenced (the offloader's `before_reuse`) and a "removed" event emitted
  pin / keep             a peer holds blocks while it pushes them (`pin`); blocks already found
                         are moved out of the way of the allocations that follow (`_keep`)
  load back              `match_prefix` extends device hits from the offload tiers
  adopt                  a peer's verified prefix joins the cache (`adopt`)
The offloader (kv_offload/) owns the tiers, never a device block's state: it is told when a
cached block goes idle (`on_cached_free`) and asked before one is reused or loaded into.
tests/engine/test_kv_state_ownership.py scans splitserve/ so that no other module reaches in.

Two groups of per-sequence cache: the paged KV of attention layers (one block table per
sequence), and, for hybrid models (Qwen3-Next), a fixed-size recurrent-state slot per running
sequence (`StateSlots`: the slot index; the tensors are engine/recurrent_state.py's pool). A
slot is taken in `admit`, ignored by `grow` and `shrink`, given back in `free_sequence` (finish,
abort, preemption: a preempted sequence recomputes its state from zeros), and `can_admit` needs a
free one. A state is not saved at block boundaries yet, so no prefix is resumable: with a state
group `match_prefix` finds nothing and prefix caching must be off (docs/architecture.md,
"Hybrid models with recurrent state").

320 lines, kept in one module on purpose: test_kv_state_ownership.py checks that block state
changes nowhere else, and each transition above is a method of the one owner; `StateSlots`
(the second group) is the piece to move out once state checkpoints give it transitions of its own.
"""

from __future__ import annotations

from collections import OrderedDict

from splitserve.core.block_events import BlockEvent
from splitserve.core.hashing import block_hashes
from splitserve.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


class StateSlots:
    """Which recurrent-state slots are free; a sequence holds at most one."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            return
        if not self._free:
            raise NoFreeBlocksError(f"no free recurrent-state slot ({self.num_slots} in use)")
        seq.state_slot = self._free.pop()

    def give_back(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self._free.append(seq.state_slot)
            seq.state_slot = -1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, hash_seed: int = 0, enable_prefix_caching: bool = True,
                 offload=None, state_slots: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        # Free blocks, least recently used first. Cached blocks stay here until reused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._events: list[BlockEvent] = []
        self._offload = offload  # KVOffloader (engine/kv_offload/): host and disk tiers under this pool, or None
        # hybrid models: the recurrent-state group (a slot per admitted sequence), or None
        self.state = StateSlots(state_slots) if state_slots else None
        if self.state is not None and (enable_prefix_caching or offload is not None):
            raise ValueError("a recurrent-state group has no state saved at block boundaries: prefix caching "
                             "and KV offload must be off")

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def cached_hashes(self) -> list[int]:
        """Hashes of the blocks in the device prefix cache (in use or idle)."""
        return list(self._hash_to_block)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        if self.state is not None and seq.state_slot < 0 and not self.state.num_free:
            return False
        fresh_needed = -(-(len(cached) * self.block_size + num_new_tokens) // self.block_size) - len(cached)
        return fresh_needed <= len(self._free) - self._num_idle(cached)

    def ensure_hashes(self, seq: Sequence, n_blocks: int) -> None:
        """Extend the sequence's chained block hashes to its first `n_blocks` blocks."""
        have = len(seq.block_hashes)
        if have >= n_blocks:
            return
        parent = seq.block_hashes[-1] if have else None
        seq.block_hashes.extend(block_hashes(seq.token_ids[: n_blocks * self.block_size], self.block_size,
                                             seed=self.hash_seed ^ seq.hash_salt, start_parent=parent,
                                             start_block=have))

    # ---- raw blocks (KV transfer leases, the draft pool, pulls) -------------------------
    def allocate_blocks(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._take_free() for _ in range(n)]

    def release_blocks(self, block_ids: list[int]) -> None:
        # Tail blocks first, so a sequence's head (the most shareable prefix) is evicted last.
        for b in reversed(block_ids):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] < 0:
                raise AssertionError(f"KV block {b} released more often than taken")
            if self._ref_counts[b] == 0:
                self._free[b] = None
                if self._block_hash[b] is None:  # nothing to reuse: hand it out first
                    self._free.move_to_end(b, last=False)
                elif self._offload is not None:  # idle and cached: written down in the background
                    self._offload.on_cached_free(b, self._block_hash[b])

    def pin(self, block_ids: list[int]) -> None:
        """Hold blocks found by `match_prefix` (a peer pushing them): not evicted until released."""
        for b in block_ids:
            self._take_cached(b)

    def allocate_behind(self, cached: list[int], n: int) -> list[int] | None:
        """`n` fresh blocks that evict none of `cached` (blocks found by `match_prefix` and not
        held), or None when the pool has not that many to spare."""
        if n > len(self._free) - self._num_idle(cached):
            return None
        self._keep(cached)
        return self.allocate_blocks(n)

    def adopt(self, block_ids: list[int], hashes: list[int], parent: int | None) -> None:
        """Blocks allocated here and filled with verified KV from elsewhere (a peer's prefix)
        join the prefix cache idle; the caller's hold on them ends."""
        self._publish(block_ids, hashes, parent)
        self.release_blocks(block_ids)

    # ---- sequences ------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the sequence's leading tokens, device first, then loaded back
        from the offload tiers. The last token is always recomputed (its logits are needed),
        so at most (num_tokens - 1) tokens match."""
        if not self.enable_prefix_caching:
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        self.ensure_hashes(seq, usable)
        hits = []
        for h in seq.block_hashes[:usable]:
            b = self._hash_to_block.get(h)
            if b is None:
                break
            hits.append(b)
        if self._offload is not None and len(hits) < usable:
            hits += self._load_back(seq, hits, usable)
        return hits

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give a waiting sequence its cached prefix blocks (it then computes the rest)."""
        if self.state is not None:
            self.state.take(seq)
        for b in cached:
            self._take_cached(b)
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_registered_blocks = len(cached)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Allocate the blocks `num_new_tokens` more tokens will be written to."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need:
            seq.block_table.extend(self.allocate_blocks(need))

    def shrink(self, seq: Sequence, keep_blocks: int) -> None:
        """Release the blocks past the first `keep_blocks` (rejected drafts' slots)."""
        if len(seq.block_table) > keep_blocks:
            self.release_blocks(seq.block_table[keep_blocks:])
            del seq.block_table[keep_blocks:]

    def free_sequence(self, seq: Sequence) -> None:
        if self.state is not None:
            self.state.give_back(seq)
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def publish_full_blocks(self, seq: Sequence) -> None:
        """After a step: register blocks that are now full and computed under their hash."""
        if not self.enable_prefix_caching:
            return
        # (computed drafts are not the sequence's tokens until accepted: engine/spec/)
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = seq.num_registered_blocks
        if full <= start:
            return
        self.ensure_hashes(seq, full)
        self._publish(seq.block_table[start:full], seq.block_hashes[start:full],
                      seq.block_hashes[start - 1] if start > 0 else None)
        seq.num_registered_blocks = full

    # ---- events and resets ----------------------------------------------------------------
    def drain_events(self) -> list[BlockEvent]:
        if self._offload is not None:
            self._renote_lost()
        events, self._events = self._events, []
        return events + (self._offload.drain_events() if self._offload is not None else [])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no running sequence holds (and the offload tiers)."""
        if self._offload is not None:
            self._offload.clear()
        for b in list(self._free):
            self._unpublish(b)

    # ---- the transitions ------------------------------------------------------------------
    def _take_free(self) -> int:
        """The least recently used free block, held once; its cached content is evicted."""
        b, _ = self._free.popitem(last=False)
        if self._offload is not None:  # its pending write-down happens now or never
            self._offload.before_reuse(b)
        self._unpublish(b)
        self._ref_counts[b] = 1
        return b

    def _take_cached(self, b: int) -> None:
        if self._ref_counts[b] == 0:
            del self._free[b]
        self._ref_counts[b] += 1

    def _publish(self, block_ids: list[int], hashes: list[int], parent: int | None) -> None:
        """Blocks holding the chain segment `hashes` (after `parent`) join the prefix cache.
        A twin already published keeps the entry (the copy here is then a plain block); the
        event names the whole segment, as the router adds (worker, hash) idempotently."""
        for b, h in zip(block_ids, hashes, strict=True):
            if h not in self._hash_to_block:
                self._hash_to_block[h] = b
                self._block_hash[b] = h
        if hashes:
            self._events.append(BlockEvent("stored", list(hashes), parent))

    def _unpublish(self, b: int) -> None:
        h = self._block_hash[b]
        if h is None:
            return
        self._block_hash[b] = None
        if self._hash_to_block.get(h) == b:
            del self._hash_to_block[h]
            # One event for a run of evictions (a prompt taking 18 blocks evicts 18): each event
            # is a message to every router, and order is kept, as only adjacent ones merge.
            if self._events and self._events[-1].kind == "removed":
                self._events[-1].block_hashes.append(h)
            else:
                self._events.append(BlockEvent("removed", [h]))

    def _num_idle(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def _keep(self, blocks: list[int]) -> None:
        """Idle ones among `blocks` to the MRU end: the allocations that follow evict others."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                self._free.move_to_end(b)

    def _load_back(self, seq: Sequence, hits: list[int], usable: int) -> list[int]:
        """Device blocks holding the prefix blocks after `hits` that a tier had (maybe none).

        Each is loaded into a block taken from the LRU end of the free list and left cached
        and idle at its MRU end, so the sequence takes it exactly like a device hit (`can_admit`
        counts it as reusable, `admit` takes it). Loading never shrinks the free list (one block
        out, the same block back) and never evicts the hits it extends: they are kept first and
        the number of loads is capped by the blocks in front of them."""
        wanted = seq.block_hashes[len(hits):usable]
        n = min(self._offload.match(wanted), len(self._free) - self._num_idle(hits))
        if n <= 0:
            return []
        self._keep(hits)
        loaded: list[int] = []
        for h in wanted[:n]:
            b = self._take_free()
            self._ref_counts[b] = 0
            self._free[b] = None  # back at the MRU end: cached, most recently used
            if not self._offload.load(h, b):
                self._free.move_to_end(b, last=False)  # holds nothing: handed out first
                break
            loaded.append(b)
        self._publish(loaded, wanted[:len(loaded)], seq.block_hashes[len(hits) - 1] if hits else None)
        return loaded

    def _renote_lost(self) -> None:
        """Blocks whose files went with the disk tier's directory: those still cached here
        and idle are noted for write-down again, so they reach the new directory."""
        for h in self._offload.take_rewrites():
            b = self._hash_to_block.get(h)
            if b is not None and self._ref_counts[b] == 0:
                self._offload.on_cached_free(b, h)
