"""Per-rank segments: where the mooncake backend's one-sided writes read and land.

A segment is one registered memory region holding KV heads [first_head, first_head +
num_heads) of every block, laid out like a pool of that many heads (block-major, so a
block's layer range is contiguous in it). A one-rank pool is one segment of all heads; a
tensor-parallel engine's pool (engine/parallel/kv_shards.py) is one segment per rank,
each rank's own pool shard. The receiver registers each of its segments with Mooncake
and describes them (ReceiverInfo.segments); the sender writes each block's region once
per receiver segment, so each rank's pool gets exactly its heads, as the grpc backend's
scatter would put them:

- a sender segment holding exactly the same heads (equal TP sizes): written straight
  from that shard, no copy;
- otherwise (TP 1 -> 2, 2 -> 1, 4 -> 2): those heads are first gathered from the
  canonical (every head) regions the sender checksums anyway, into a host buffer the
  sender registers for the push (`staged`).

A stream block is in place once every receiver segment's write of it landed; only then
is it reported with its checksum (over every head, as grpc's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.engine.parallel.kv_shards import ShardedKVPool
from splitserve.kvtransfer.mooncake_endpoint import Write, coalesce
from splitserve.kvtransfer.pool_io import RegionLayout, _read_only_tensor


class Segment(NamedTuple):
    base: int  # address of block 0 of the segment
    first_head: int
    num_heads: int


class Region(NamedTuple):
    """A memory region to register with Mooncake."""

    addr: int
    nbytes: int
    device_type: str


def pool_segments(pool: KVCachePool | ShardedKVPool) -> list[Segment]:
    """The pool's segments: its ranks' shards in rank order, or the whole pool."""
    if isinstance(pool, ShardedKVPool):
        return [Segment(s.data_ptr(), first, n) for s, (first, n) in zip(pool.shards, pool.ranges, strict=True)]
    return [Segment(pool.data_ptr(), 0, pool.spec.num_kv_heads)]


def pool_regions(pool: KVCachePool | ShardedKVPool) -> list[Region]:
    """What registering the pool with Mooncake means: every rank's shard, or the pool."""
    if isinstance(pool, ShardedKVPool):
        return [Region(s.data_ptr(), s.numel() * s.element_size(), s.device.type) for s in pool.shards]
    return [Region(pool.data_ptr(), pool.nbytes, pool.data.device.type)]


def segment_layout(layout: RegionLayout, spec: KVCacheSpec, num_heads: int) -> RegionLayout:
    """`layout` (a layer range of every head) in a segment of `num_heads` heads."""
    block = spec.block_nbytes // spec.num_kv_heads * num_heads
    return RegionLayout(block, block // spec.num_layers, layout.layer_start, layout.layer_end, layout.num_layers)


def check_segments(segments: Sequence[Segment], num_kv_heads: int) -> str | None:
    """Why a receiver's segments cannot be written into (None: they can). Pure."""
    covered: set[int] = set()
    for seg in segments:
        if seg.base <= 0 or seg.num_heads < 1 or seg.first_head < 0 or seg.first_head + seg.num_heads > num_kv_heads:
            return f"segment {list(seg)} is not a registered range of the pool's {num_kv_heads} KV heads"
        covered.update(range(seg.first_head, seg.first_head + seg.num_heads))
    if covered != set(range(num_kv_heads)):
        return f"its segments hold KV heads {sorted(covered)}, not all {num_kv_heads}"
    return None


@dataclass
class OneSidedPlan:
    """One push's writes. `parts`: writes that cover each stream block (one per receiver
    segment); `staged`: host buffers writes read from, registered for the push only."""

    writes: list[Write]
    parts: int = 1
    staged: list[torch.Tensor] = field(default_factory=list)


def gather_heads(regions: Sequence[memoryview], spec: KVCacheSpec, layout: RegionLayout,
                 first: int, n: int) -> torch.Tensor:
    """Heads [first, first + n) of each canonical (every head) region, packed into one host
    buffer as a segment of n heads lays them out: [blocks, layers, parts, block_size, n, head_dim]."""
    layers = layout.layer_end - layout.layer_start
    shape = (layers, spec.parts, spec.block_size, spec.num_kv_heads, spec.head_dim)
    out = torch.empty((len(regions), *shape[:3], n, spec.head_dim), dtype=spec.dtype)
    for i, region in enumerate(regions):
        out[i].copy_(_read_only_tensor(region).view(spec.dtype).view(shape)[..., first:first + n, :])
    return out


def plan(src_segments: Sequence[Segment], dest_segments: Sequence[Segment], spec: KVCacheSpec,
         layout: RegionLayout, src_block_ids: Sequence[int], dest_block_ids: Sequence[int],
         regions: Sequence[memoryview]) -> OneSidedPlan:
    """The writes that put every stream block's region into each receiver segment (adjacent
    regions merged), from a sender segment with the same heads or from a staged gather."""
    writes: list[Write] = []
    staged: list[torch.Tensor] = []
    by_heads = {(s.first_head, s.num_heads): s for s in reversed(src_segments)}  # the first holder wins
    for dest in dest_segments:
        seg = segment_layout(layout, spec, dest.num_heads)
        dst = [dest.base + seg.offset(b) for b in dest_block_ids]
        same = by_heads.get((dest.first_head, dest.num_heads))
        if same is not None:
            src = [same.base + seg.offset(b) for b in src_block_ids]
        else:
            buf = gather_heads(regions, spec, layout, dest.first_head, dest.num_heads)
            staged.append(buf)
            src = [buf.data_ptr() + i * seg.region_nbytes for i in range(len(src_block_ids))]
        writes += coalesce(src, dst, seg.region_nbytes)
    return OneSidedPlan(writes, len(dest_segments), staged)
