"""Load-back: a prefix lookup that missed the device pool but hits a tier.

The blocks come back into fresh device blocks taken from the free list's LRU end, are
published under their hash (a "stored" event for the device) and left cached-free at its
MRU end, so the sequence then takes them exactly like device hits (`can_admit` counts
them as reusable, `admit` takes them). Loading never shrinks the free list (one block out,
the same block back), and it never evicts the device hits it extends: those are moved to
the MRU end first and the number of loads is capped by the blocks in front of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.core.block_events import BlockEvent

if TYPE_CHECKING:
    from splitserve.engine.block_manager import BlockManager
    from splitserve.engine.sequence import Sequence


def load_from_tiers(bm: BlockManager, seq: Sequence, hits: list[int], usable: int) -> list[int]:
    """Device blocks holding the prefix blocks after `hits` that a tier had (maybe none)."""
    offload = bm.offload
    wanted = seq.block_hashes[len(hits):usable]
    n = offload.match(wanted) if wanted else 0
    idle_hits = [b for b in hits if bm.ref_counts[b] == 0]
    n = min(n, len(bm.free) - len(idle_hits))
    if n <= 0:
        return []
    for b in idle_hits:  # in use now: they must outlive the evictions below
        bm.free.move_to_end(b)
    loaded: list[int] = []
    for h in wanted[:n]:
        b = bm._take_free()
        bm.ref_counts[b] = 0
        if not offload.load(h, b):
            bm.free[b] = None
            bm.free.move_to_end(b, last=False)  # holds nothing: handed out first
            break
        bm.free[b] = None  # cached, most recently used
        bm.block_hash[b] = h
        bm.hash_to_block[h] = b
        loaded.append(b)
    if loaded:
        parent = seq.block_hashes[len(hits) - 1] if hits else None
        bm.events.append(BlockEvent("stored", seq.block_hashes[len(hits):len(hits) + len(loaded)], parent))
    return loaded
