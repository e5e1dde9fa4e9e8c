"""A tensor-parallel engine's KV pool as the KV transfer sees it: every KV head of each
block, in the layout of a one-rank pool ([layers, 2, block_size, kv_heads, head_dim] a
block), assembled from the ranks' pools, each of which holds its own head range.

Why this way: the KV transfer runs in the worker process, while rank r's pool lives in
rank r's process. Each rank shares its pool tensor (shared memory on the CPU), rank 0
collects the handles once at start (`TensorParallelGroup.share_kv_pools`) and the worker
receives them with rank 0's. A push then gathers the head slices of its blocks into one
buffer (one copy, where a one-rank pool is read in place) and the wire carries whole
blocks; a receiver scatters each block's heads to the ranks holding them. So the wire
format does not depend on either side's TP size: prefill TP=1 -> decode TP=2, 2 -> 1,
2 -> 2 and 4 -> 2 are all the same transfer, re-sharded by head ranges on the receiving
side. Rank 0 gathering over the TP group instead would stop the engine loop for every
push and carry the bytes through the engine's pipe. The mooncake backend, which cannot
scatter on arrival (its writes are one-sided), registers each of `shards` as a segment of
its own and writes each rank's heads there (kvtransfer/segments.py).

A KV head held by several ranks (fewer KV heads than ranks: `sharding.kv_heads`) is read
from the first and written to all of them."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from splitserve.core.model_config import ModelConfig
from splitserve.engine.kv_cache import KVCacheSpec
from splitserve.engine.parallel.sharding import kv_heads
from splitserve.engine.parallel.state import TPState


def head_ranges(cfg: ModelConfig, size: int) -> list[tuple[int, int]]:
    """(first KV head, number) each rank holds, in rank order."""
    return [kv_heads(cfg, TPState(rank, size)) for rank in range(size)]


def readers(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(rank, first head, number of heads) to read so that each head is read once, from the
    first rank that holds it. Pure."""
    out, covered = [], set()
    for rank, (first, n) in enumerate(ranges):
        heads = [h for h in range(first, first + n) if h not in covered]
        if heads:  # a rank's range is contiguous, and so is what is left of it
            out.append((rank, heads[0], len(heads)))
            covered.update(heads)
    return out


class ShardedKVPool:
    """The ranks' pools as one pool of `spec` (all KV heads). `shards[r]`: rank r's pool
    tensor [blocks, layers, 2, block_size, its kv heads, head_dim], shared with this process."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, shards: list[torch.Tensor],
                 ranges: Sequence[tuple[int, int]]):
        if len(shards) != len(ranges):
            raise ValueError(f"{len(shards)} pool shards for {len(ranges)} head ranges")
        for shard, (_, n) in zip(shards, ranges, strict=True):
            if shard.shape[4] != n or shard.shape[0] < num_blocks:
                raise ValueError(f"a pool shard of shape {list(shard.shape)} does not hold {n} heads "
                                 f"of {num_blocks} blocks")
        self.spec = spec
        self.num_blocks = num_blocks
        self.shards = shards
        self.ranges = list(ranges)
        self._readers = readers(self.ranges)
        self._lock = threading.Lock()
        self._spare: torch.Tensor | None = None  # read_bytes' reusable gather buffer

    def __getstate__(self) -> dict:  # crosses to the worker process: the shards as shared-memory handles
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_spare")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _spare=None)

    @classmethod
    def of(cls, cfg: ModelConfig, rank_spec: KVCacheSpec, num_blocks: int, shards: list[torch.Tensor]):
        return cls(replace(rank_spec, num_kv_heads=cfg.num_kv_heads), num_blocks, shards,
                   head_ranges(cfg, len(shards)))

    @property
    def nbytes(self) -> int:
        """The memory of all ranks' pools (replicated heads count on each rank)."""
        return sum(s.numel() * s.element_size() for s in self.shards)

    def read(self, block_ids: Sequence[int], layer_start: int = 0, layer_end: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Layers [layer_start, layer_end) of the blocks with every head, on the CPU:
        [n, layers, parts, block_size, kv_heads, head_dim], contiguous (a copy, into `out` if given)."""
        layer_end = self.spec.num_layers if layer_end is None else layer_end
        s = self.spec
        shape = (len(block_ids), layer_end - layer_start, s.parts, s.block_size, s.num_kv_heads, s.head_dim)
        out = torch.empty(shape, dtype=s.dtype) if out is None else out.view(shape)
        # a copy per block and rank: gathering the blocks with an index tensor first ran ~15x
        # slower on the CPU (64 MiB of bf16: 64 ms against 4.5 ms, bench/experiments/tp_kv_transfer.py)
        for rank, first, n in self._readers:
            shard, local = self.shards[rank], first - self.ranges[rank][0]
            for i, block in enumerate(block_ids):
                out[i, :, :, :, first:first + n].copy_(shard[block, layer_start:layer_end, :, :, local:local + n])
        return out

    def read_bytes(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> np.ndarray:
        """read() as bytes, gathered into the pool's spare buffer when no earlier read still
        uses it: a fresh buffer pays a page fault per 4 KiB on first touch, which cost ~10x
        the copy itself (64 MiB: ~45 ms against ~5 ms). The buffer is handed back when the
        returned array (and every view of it) is gone."""
        nbytes = len(block_ids) * (layer_end - layer_start) * self.spec.block_nbytes // self.spec.num_layers
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None or spare.numel() < nbytes:
            spare = torch.empty(nbytes, dtype=torch.uint8)
        self.read(block_ids, layer_start, layer_end, out=spare[:nbytes].view(self.spec.dtype))
        host = spare[:nbytes].numpy()
        weakref.finalize(host, self._give_back, spare)
        return host

    def _give_back(self, spare: torch.Tensor) -> None:
        with self._lock:
            if self._spare is None or self._spare.numel() < spare.numel():
                self._spare = spare

    def write(self, block_ids: Sequence[int], blocks: torch.Tensor, layer_start: int = 0) -> None:
        """Store `blocks` ([n, layers, 2, block_size, kv_heads, head_dim], every head) into
        layers from `layer_start` of the blocks: each rank gets the heads it holds."""
        layer_end = layer_start + blocks.shape[1]
        for shard, (first, n) in zip(self.shards, self.ranges, strict=True):
            for i, block in enumerate(block_ids):
                shard[block, layer_start:layer_end].copy_(blocks[i, :, :, :, first:first + n])
