"""The host tier: a second, larger pool of KV blocks in host memory, keyed by block hash.

One uint8 tensor of `capacity` slots of `block_nbytes` each (pinned when the device pool
is on a GPU, so copies back are DMA). Slots are kept in LRU order; the offloader evicts
the least recently used entry when it needs a slot, and writes it down to disk first.
Not thread-safe: the offloader serializes every call under its lock.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, capacity_blocks: int, block_nbytes: int, pin_memory: bool = False):
        if capacity_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.block_nbytes = block_nbytes
        self.data = torch.empty((capacity_blocks, block_nbytes), dtype=torch.uint8, pin_memory=pin_memory)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self.free_slots = list(range(capacity_blocks - 1, -1, -1))

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def touch(self, block_hash: int) -> None:
        self.slot_of.move_to_end(block_hash)

    def take_slot(self) -> int | None:
        """A free slot, or None when every slot holds a block."""
        return self.free_slots.pop() if self.free_slots else None

    def give_back(self, slot: int) -> None:
        self.free_slots.append(slot)

    def publish(self, block_hash: int, slot: int) -> None:
        """The slot now holds the block `block_hash` (most recently used)."""
        self.slot_of[block_hash] = slot

    def pop_lru(self) -> tuple[int, int] | None:
        """(hash, slot) of the least recently used block, unindexed: nothing finds it any
        more, but its bytes stay in the slot until the caller gives the slot back."""
        if not self.slot_of:
            return None
        return self.slot_of.popitem(last=False)

    def remove(self, block_hash: int) -> None:
        slot = self.slot_of.pop(block_hash, None)
        if slot is not None:
            self.free_slots.append(slot)

    def slot(self, slot: int) -> torch.Tensor:
        return self.data[slot]

    def lookup(self, block_hash: int) -> int | None:
        return self.slot_of.get(block_hash)

    def clear(self) -> list[int]:
        """Forget every block; returns their hashes."""
        hashes = list(self.slot_of)
        for h in hashes:
            self.remove(h)
        return hashes
