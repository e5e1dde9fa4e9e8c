"""Receiver side of a one-sided (mooncake) push: verify blocks as the sender reports them landed.

The sender's `written` reports name stream blocks whose write is in place here, each
with the xxh3 of the source region. Verifying them as they come overlaps the hashing
with the writes still on the wire; at commit every block must have been reported once.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer.pool_io import RegionLayout, host_regions
from splitserve.kvtransfer.wire import TransferHeader


class WrittenBlocks:
    def __init__(self, pool: KVCachePool, header: TransferHeader):
        self.pool = pool
        self.dest = header.dest_block_ids
        self.layout = RegionLayout.of(pool, (header.layer_start, header.layer_end))
        self.verified = bytearray(len(self.dest))
        self.mismatches: list[tuple[int, int, int]] = []  # (stream block, xxh3 here, xxh3 reported)

    def report(self, indices: Sequence[int], sums: Sequence[int]) -> int:
        """Check the reported blocks in place; returns their bytes. ValueError if the report
        is malformed (a block outside the transfer, or reported twice)."""
        n = len(self.dest)
        for i in indices:
            if not 0 <= i < n:
                raise ValueError(f"a written-block report names stream block {i}, outside the transfer's {n} blocks")
            if self.verified[i]:
                raise ValueError(f"stream block {i} was reported written twice")
            self.verified[i] = 1
        regions = host_regions(self.pool, [self.dest[i] for i in indices], self.layout)
        for i, want, region in zip(indices, sums, regions, strict=True):
            got = xxhash.xxh3_64_intdigest(region)
            if got != want:
                self.mismatches.append((i, got, want))
        return len(indices) * self.layout.region_nbytes

    def missing(self) -> list[int]:
        return [i for i, done in enumerate(self.verified) if not done]
