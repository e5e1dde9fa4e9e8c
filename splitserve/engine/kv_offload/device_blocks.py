"""The device blocks the offload tiers copy: one pool's, or a tensor-parallel engine's every
rank's pool as one.

A tier holds a block in the layout of a one-rank pool, every KV head of it
([layers, 2, block_size, kv_heads, head_dim], `block_nbytes` bytes). Under tensor parallelism
rank r's pool holds only its heads of each block, in rank r's process; rank 0 has every rank's
pool tensor shared with it already (parallel/kv_shards.py, the handles the KV transfer uses),
so a write-down gathers the heads of one block from the ranks' pools into the host slot or the
file's buffer, and a load-back scatters them to the ranks holding them. One file per block,
with one MAC and one checksum over all of its heads: a block is a hit only when the whole of
it is there and verified, for every rank at once. No collective and no step: the ranks never
hear of the tiers (docs/architecture.md, "KV offload tiers", under tensor parallelism).

Ordering: a block is copied only while idle (no step writes it) or while the engine thread
holds it before any step reads it; on the CPU the pools are shared memory, and on CUDA a
step's KV writes on every rank are done once rank 0 has its logits (they precede the
all-reduces the logits depend on), and a synchronous copy into a rank's pool is done before
the next step is broadcast.
"""

from __future__ import annotations

import torch

from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.engine.parallel.kv_shards import ShardedKVPool


class PoolBlocks:
    """One pool's blocks: each a contiguous run of bytes of its tensor."""

    def __init__(self, pool: KVCachePool):
        self.pool = pool
        self.spec: KVCacheSpec = pool.spec
        self.on_gpu = pool.data.device.type != "cpu"

    def _view(self, block_id: int) -> torch.Tensor:
        # a fresh view each time: the pool may have moved to shared memory since
        start = self.pool.block_offset(block_id)
        return self.pool.data.view(-1).view(torch.uint8)[start:start + self.spec.block_nbytes]

    def read_into(self, block_id: int, dst: torch.Tensor) -> None:
        """Copy the block into `dst` (uint8, block_nbytes, on the host)."""
        dst.copy_(self._view(block_id))

    def write_from(self, block_id: int, src: torch.Tensor) -> None:
        """Copy `src` (uint8, block_nbytes) into the block."""
        self._view(block_id).copy_(src)


class ShardedBlocks:
    """A tensor-parallel engine's blocks, every head, read from and written to the ranks' pools."""

    def __init__(self, pool: ShardedKVPool):
        self.pool = pool
        self.spec: KVCacheSpec = pool.spec  # every KV head: the layout of a one-rank pool
        self.on_gpu = pool.shards[0].device.type != "cpu"

    def read_into(self, block_id: int, dst: torch.Tensor) -> None:
        self.pool.read([block_id], out=dst.view(self.spec.dtype))

    def write_from(self, block_id: int, src: torch.Tensor) -> None:
        self.pool.write([block_id], src.view(self.spec.dtype).view(1, *self.spec.block_shape))


def device_blocks(pool: KVCachePool | ShardedKVPool) -> PoolBlocks | ShardedBlocks:
    return ShardedBlocks(pool) if isinstance(pool, ShardedKVPool) else PoolBlocks(pool)
