"""What a prefix cache reports when it publishes or evicts blocks: the engine's block
manager emits these, and a worker's presence turns them into numbered KV events on the
cluster bus (cluster/messages.py), which routers fold into their index."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BlockEvent:
    kind: str  # "stored" | "removed"
    block_hashes: list[int]
    parent: int | None = None  # hash of the block before the first stored one
    tier: str = "device"  # where the blocks are: device (the KV pool), host or disk (engine/kv_offload/)
